"""Medians per (prompt set, latency, mode, draft), ratios vs plain, Markdown, the PNG plot."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]
ALL = "all"
COLORS = {
    "ngram": "tab:blue",
    "best": "tab:green",
    "head": "tab:purple",
    "hybrid": "tab:orange",
    "hybrid_chain": "tab:olive",
    "mtp": "tab:brown",
    "mtp_coordinator": "tab:pink",
    "oracle": "tab:red",
}


def summarize(runs: Sequence[Record]) -> list[Record]:
    """One row per (set, latency, mode, draft), sets first then ``all``; medians over prompts;
    ``ratio_*`` divide by plain's median at the same set and latency."""
    sets = [*dict.fromkeys(r["set"] for r in runs), ALL]
    keys = list(dict.fromkeys((r["latency_ms"], r["mode"], r["draft"]) for r in runs))
    rows = []
    for s in sets:
        for latency, mode, draft in keys:
            group = [
                r
                for r in runs
                if (s == ALL or r["set"] == s)
                and (r["latency_ms"], r["mode"], r["draft"]) == (latency, mode, draft)
            ]
            if group:
                rows.append(_row(s, latency, mode, draft, group))
    for row in rows:
        plain = next(
            (
                p
                for p in rows
                if (p["set"], p["latency_ms"], p["mode"])
                == (row["set"], row["latency_ms"], "plain")
            ),
            None,
        )
        for key in ("decode_tok_s", "tok_s"):
            base = plain[key] if plain else None
            row[f"ratio_{key}"] = row[key] / base if base and row[key] is not None else None
    return rows


def _row(s: str, latency: float, mode: str, draft: str | None, group: list[Record]) -> Record:
    def bound(key: str) -> Callable[[Record], Any]:
        return lambda r: r["bound"][key] if r["bound"] else None

    return {
        "set": s,
        "latency_ms": latency,
        "mode": mode,
        "draft": draft,
        "prompts": len(group),
        "decode_tok_s": _median(group, lambda r: r["decode_tok_s"]),
        "tok_s": _median(group, lambda r: r["tok_s"]),
        "alpha": _median(group, lambda r: r["alpha"]),
        "k": _median(group, bound("k")),
        "tokens_per_chunk": _median(group, lambda r: r["tokens_per_chunk"]),
        "mean_lap_s": _median(group, lambda r: r["mean_lap_s"]),
        "max_depth": _median(group, lambda r: r["max_depth"]),
        "stale_dropped": sum(r["stale_dropped"] for r in group),
        "branches": sum(r.get("branches", 0) for r in group),
        "branches_won": sum(r.get("branches_won", 0) for r in group),
        "lap0_s": _median(group, bound("lap0_s")),
        "contention": _median(group, bound("contention")),
        "bound_tok_s": _median(group, bound("steady_tok_s")),
        "request_bound_tok_s": _median(group, bound("request_tok_s")),
        "vs_bound": _median(group, lambda r: r.get("vs_bound")),
        "vs_request_bound": _median(group, lambda r: r.get("vs_request_bound")),
        "limited_by": _mode_of([r["bound"]["limited_by"] for r in group if r["bound"]]),
        "identical": f"{sum(r['identical'] for r in group)}/{len(group)}",
    }


def _median(group: Sequence[Record], get: Callable[[Record], Any]) -> float | None:
    values = [v for v in map(get, group) if v is not None]
    return statistics.median(values) if values else None


def _mode_of(values: list[str]) -> str | None:
    return max(set(values), key=values.count) if values else None


def table(rows: Sequence[Record], s: str = ALL) -> str:
    """Markdown: one line per latency, mode and draft of set ``s``; times in ms."""
    out = [
        "| latency | mode | draft | decode tok/s | × plain | tok/s (e2e) | α | K | tok/chunk | "
        "lap | D | lap0 | bound | meas/bound | req. bound | meas/req. | identical |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["set"] != s:
            continue
        out.append(
            f"| {r['latency_ms']:g} ms | {r['mode']} | {r['draft'] or '–'} | "
            f"{_f(r['decode_tok_s'], 1)} | {_f(r['ratio_decode_tok_s'], 2, '×')} | "
            f"{_f(r['tok_s'], 1)} | {_f(r['alpha'], 2)} | {_f(r['k'], 1)} | "
            f"{_f(r['tokens_per_chunk'], 2)} | {_ms(r['mean_lap_s'])} | "
            f"{_f(r['max_depth'], 0)} | {_ms(r['lap0_s'])} | {_f(r['bound_tok_s'], 1)} | "
            f"{_f(r['vs_bound'], 2)} | {_f(r['request_bound_tok_s'], 1)} | "
            f"{_f(r['vs_request_bound'], 2)} | {r['identical']} |"
        )
    return "\n".join(out)


def by_set(rows: Sequence[Record]) -> str:
    """Markdown: decode tok/s (× plain) per set, one line per latency, mode and draft."""
    sets = [s for s in dict.fromkeys(r["set"] for r in rows)]
    keys = list(dict.fromkeys((r["latency_ms"], r["mode"], r["draft"]) for r in rows))
    out = ["| latency | mode | draft | " + " | ".join(sets) + " |"]
    out.append("|---:|---|---|" + "---:|" * len(sets))
    for latency, mode, draft in keys:
        cells = []
        for s in sets:
            row = next(
                (r for r in rows if (r["set"], r["latency_ms"], r["mode"], r["draft"])
                 == (s, latency, mode, draft)),
                None,
            )  # fmt: skip
            cells.append(
                "–"
                if row is None
                else f"{_f(row['decode_tok_s'], 1)} ({_f(row['ratio_decode_tok_s'], 1, '×')})"
            )
        out.append(f"| {latency:g} ms | {mode} | {draft or '–'} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _f(x: float | None, digits: int, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def plot(rows: Sequence[Record], out: Path, title: str) -> None:
    """Median decode tok/s against latency, one panel per set (log y); dotted: the oracle's
    pipelined bound. Errors: ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["set"] for r in rows))
    cols = min(len(sets), 3)
    fig, axes = plt.subplots(
        (len(sets) + cols - 1) // cols, cols, figsize=(5 * cols, 4 * ((len(sets) + 2) // 3)),
        squeeze=False, sharey=True,
    )  # fmt: skip
    for ax, s in zip(axes.flat, sets, strict=False):
        lines = list(dict.fromkeys((r["mode"], r["draft"]) for r in rows if r["set"] == s))
        for mode, draft in lines:
            pts = sorted(
                (r["latency_ms"], r["decode_tok_s"], r["bound_tok_s"])
                for r in rows
                if (r["set"], r["mode"], r["draft"]) == (s, mode, draft) and r["decode_tok_s"]
            )
            xs = [p[0] for p in pts]
            style = {"plain": ":", "spec": "--", "pipelined": "-"}[mode]
            color = COLORS.get(draft or "", "black")
            label = mode if draft is None else f"{mode}, {draft}"
            ax.plot(xs, [p[1] for p in pts], style, color=color, marker="o", label=label)
            if (mode, draft) == ("pipelined", "oracle"):
                ys = [p[2] for p in pts]
                ax.plot(xs, ys, ":", color="gray", marker="x", label="bound: pipelined, oracle")
        ax.set_title(f"{s} prompts")
        ax.set_yscale("log")
        ax.set_xlabel("emulated latency per edge (ms)")
        ax.grid(True, which="both", alpha=0.3)
    spare = list(axes.flat[len(sets) :])
    for ax in spare:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel("decode tok/s (median)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    where = spare[0] if spare else axes[0][0]
    where.legend(handles, labels, loc="center" if spare else "best", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
