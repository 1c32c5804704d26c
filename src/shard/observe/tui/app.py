"""``MonitorApp``: the ring at a glance, in a terminal of 80×24 or more.

From top to bottom: the feed's link state, the ring (each edge's one-way transit, last /
median, and the lap: the ring's round trip), the headline numbers (tok/s, α, K, D, sessions,
standbys; spot checks once there are any: the evicted nodes and the newest evidence file),
sparklines of tok/s and α, the per-stage table and the event log, newest first. Unknown
values show as "–", never as 0. A node evicted after failed audits leaves the ring line once
it is replaced (the feed drops it, ``shard.observe.status``); until then it is struck through.

The app is fed through one method, ``show(event)``, called on the app's thread: by the Trio
feed client (``shard.observe.tui.feed``, running as a guest of this loop:
``shard.observe.tui.guest``) or by
a test. It folds each event into a ``MonitorState`` (``shard.observe.tui.state``) and redraws,
unless
paused. Bindings: ``q`` quits, ``p`` pauses / resumes the display (events are still taken in,
so resuming shows the latest), ``r`` resets the rolling statistics here and, through
``on_reset``, on the coordinator.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, tzinfo
from typing import ClassVar

from rich.console import RenderableType
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Footer, Sparkline, Static

from shard.messages import EventRecord, StatusSnapshot
from shard.observe.tui import state as st
from shard.observe.tui.state import FeedEvent, MonitorState

#: Event log lines drawn (the widget clips to its height; newest first).
LOG_SHOWN = 40


class MonitorApp(App[None]):
    """The live view of one coordinator's status feed.

    ``on_reset`` is called when the operator presses ``r`` (the bridge forwards it to the
    feed client); ``clock`` stamps the monitor's own log lines; ``tz`` formats times (None:
    local time).
    """

    TITLE = "shard monitor"
    CSS = """
    Screen { layout: vertical; }
    #link, #summary, #events { text-wrap: nowrap; text-overflow: ellipsis; }
    #link { height: 1; padding: 0 1; background: $success-darken-2; color: $text; }
    #link.connecting { background: $primary-darken-2; }
    #link.reconnecting { background: $warning-darken-2; }
    #link.ring-down { background: $error-darken-2; }
    #body.stale { opacity: 60%; }
    #ring { height: auto; border: round $accent; padding: 0 1; }
    #summary { height: auto; padding: 0 1; }
    #sparks { height: 3; }
    .spark { width: 1fr; padding: 0 1; }
    .spark Static { height: 1; }
    .spark Sparkline { height: 2; }
    #stages { height: auto; max-height: 7; }
    #events { height: 1fr; min-height: 3; border-top: solid $accent; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False),
        Binding("p", "toggle_pause", "Pause"),
        Binding("r", "reset", "Reset stats"),
    ]

    def __init__(
        self,
        *,
        address: str = "",
        on_reset: Callable[[], object] = lambda: None,
        clock: Callable[[], float] = time.time,
        tz: tzinfo | None = None,
    ) -> None:
        super().__init__()
        self.state = MonitorState(address=address)
        self.paused = False
        # True from mount until exit: only then are there widgets to draw on. The feed may
        # post before the first and after the last (it is stopped after the app returns).
        self._drawable = False
        self.on_reset = on_reset
        self._clock = clock
        self._tz = tz

    def compose(self) -> ComposeResult:
        yield Static(id="link")
        with Vertical(id="body"):
            yield Static(id="ring")
            yield Static(id="summary")
            with Horizontal(id="sparks"):
                with Vertical(classes="spark"):
                    yield Static(id="tok-s-label")
                    yield Sparkline([], id="tok-s")
                with Vertical(classes="spark"):
                    yield Static(id="alpha-label")
                    yield Sparkline([], id="alpha")
            yield DataTable(id="stages", show_cursor=False, zebra_stripes=True)
            yield Static(id="events")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one("#stages", DataTable)
        table.add_columns(
            "stage", "compute ms", "median ms", "chunks", "queue", "rows/fwd", "fwd/s", "wait ms"
        )
        self.query_one("#ring", Static).border_title = "ring · one-way ms, last/median"
        self.query_one("#events", Static).border_title = "events, newest first"
        self._drawable = True
        self._draw()

    def exit(
        self,
        result: None = None,
        return_code: int = 0,
        message: RenderableType | None = None,
    ) -> None:
        self._drawable = False
        super().exit(result, return_code, message)

    # --- the feed's entry point --------------------------------------------------------------

    def show(self, event: FeedEvent) -> None:
        """Take in one feed event; redraw unless paused. Call on the app's thread."""
        self.state = st.apply(self.state, event, self._clock())
        if self._drawable and self.paused:
            self._draw_link()  # the link line stays live: a lost feed shows even when paused
        elif self._drawable:
            self._draw()

    # --- bindings ----------------------------------------------------------------------------

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if self.paused:
            self._draw_link()
        else:
            self._draw()

    def action_reset(self) -> None:
        self.state = st.reset(self.state, self._clock())
        self.on_reset()
        self._draw()

    # --- drawing -----------------------------------------------------------------------------

    def _time(self, at: float) -> str:
        return datetime.fromtimestamp(at, self._tz).strftime("%H:%M:%S")

    def _draw(self) -> None:
        self._draw_link()
        state, snap = self.state, self.state.snapshot
        self.query_one("#body").set_class(state.link != "live", "stale")
        self.query_one("#ring", Static).update(ring_text(snap))
        self.query_one("#summary", Static).update(summary_text(snap))
        tok_s = snap.tok_s if snap is not None else None
        alpha = snap.alpha if snap is not None else None
        self.query_one("#tok-s-label", Static).update(
            f"tok/s {st.UNKNOWN if tok_s is None else st.rate(tok_s)}"
        )
        self.query_one("#alpha-label", Static).update(f"α {st.ratio(alpha)}")
        for selector, history in (("#tok-s", state.tok_s), ("#alpha", state.alpha)):
            spark = self.query_one(selector, Sparkline)
            spark.data = list(history)
            spark.visible = bool(history)  # an empty sparkline draws a floor that reads as 0
        self._draw_stages(snap)
        self.query_one("#events", Static).update(self._events_text(state.log))

    def _draw_link(self) -> None:
        state = self.state
        snap = state.snapshot
        where = state.address or "the coordinator"
        if state.link == "live" and snap is not None:
            # the feed is live; the ring itself may not be (a block lost, a repair)
            mark = "✖ ring down" if snap.ring_down else "◐ repairing" if snap.repairing else ""
            text = (
                f"{mark or '● live'}  swarm {snap.swarm} · {snap.coordinator} @ {where}"
                f" · updated {self._time(snap.at)}"
            )
            if mark:
                text += f": {snap.ring_down or snap.repairing}"
        elif state.link == "reconnecting":
            text = f"⟳ reconnecting to {where} (attempt {state.attempt})"
            if state.reason:
                text += f": {state.reason}"
        else:
            text = f"◌ connecting to {where}"
            if state.attempt > 1:
                text += f" (attempt {state.attempt})"
            if state.reason:
                text += f": {state.reason}"
        if self.paused:
            text += "  ‖ PAUSED (p resumes)"
        link = self.query_one("#link", Static)
        link.update(Text(text, no_wrap=True, overflow="ellipsis"))
        link.set_class(state.link == "connecting", "connecting")
        link.set_class(state.link == "reconnecting", "reconnecting")
        down = snap is not None and bool(snap.ring_down or snap.repairing)
        link.set_class(state.link == "live" and down, "ring-down")

    def _draw_stages(self, snap: StatusSnapshot | None) -> None:
        table = self.query_one("#stages", DataTable)
        table.clear()
        for stage in snap.stages if snap is not None else ():
            table.add_row(
                stage.node,
                st.ms(stage.compute_last_s),
                st.ms(stage.compute_median_s),
                str(stage.chunks),
                st.count(stage.queue),
                st.number(stage.batch_rows_median),
                st.number(stage.forwards_per_s),
                st.ms(stage.queued_median_s),
            )

    def _events_text(self, log: tuple[EventRecord, ...]) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, event in enumerate(reversed(log[-LOG_SHOWN:])):
            if i:
                text.append("\n")
            style = "bold red" if event.kind in ("fault", "audit") else "cyan"
            text.append(f"{self._time(event.at)} ")
            text.append(f"{event.kind:<7} ", style=style)
            text.append(event.detail)
        if not log:
            text.append("no events yet", style="dim")
        return text


def ring_text(snap: StatusSnapshot | None) -> Text:
    """``coord ─0.4/0.5→ s0 ─…→ coord`` and a line with the lap (the ring's round trip).

    An edge that does not continue from the one before (one measured off the ring) starts a
    new run after `` · ``; an evicted node still in the ring is struck through."""
    text = Text()
    if snap is None:
        text.append("waiting for the first snapshot…", style="dim")
        return text
    evicted = frozenset(snap.audit.evicted)

    def node(name: str) -> None:
        text.append(name, style="bold red strike" if name in evicted else "bold")

    at = None
    for edge in snap.edges:
        if edge.src != at:
            if at is not None:
                text.append(" · ")
            node(edge.src)
        text.append(" ")
        text.append(f"─{st.ms(edge.last_s)}/{st.ms(edge.median_s)}→", style="green")
        text.append(" ")
        node(edge.dst)
        at = edge.dst
    text.append(
        f"\nlap {st.ms(snap.lap_last_s)} ms (median {st.ms(snap.lap_median_s)})"
        f" · tok/lap {st.ratio(snap.tokens_per_lap)} · laps {snap.laps}"
    )
    return text


def _audit_line(snap: StatusSnapshot) -> str:
    """Spot checks, once there are any (a swarm that does not audit shows nothing)."""
    a = snap.audit
    if not (a.audits or a.strikes or a.evictions):
        return ""
    line = f"\naudits {a.audits}  strikes {a.strikes}  evictions {a.evictions}"
    if a.evicted:
        line += f" ({', '.join(a.evicted)})"
    if a.evidence:
        line += f"\nevidence {a.evidence[-1]}"
    return line


def summary_text(snap: StatusSnapshot | None) -> Text:
    """The headline numbers: two lines, and one per GPU when the feed reports any."""
    if snap is None:
        return Text("")
    standbys = ", ".join(snap.standbys) if snap.standbys else "none"
    return Text(
        f"tok/s {st.rate(snap.tok_s)}  α {st.ratio(snap.alpha)}"
        f" ({snap.accepted}/{snap.drafted})  K {snap.k}  D {snap.depth}"
        f"  sessions {snap.sessions}\n"
        f"requests {snap.requests_done} done, {snap.requests_failed} failed"
        f"  tokens {snap.tokens}  standbys {standbys}"
        + _audit_line(snap)
        + "".join(f"\n{st.device(d)}" for d in snap.devices),
        no_wrap=True,
        overflow="ellipsis",
    )
