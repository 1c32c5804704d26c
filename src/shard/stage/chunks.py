"""A chunk's checks before it runs, and its output after: what every chunk of a batch gets
on its own (``shard.stage.executor`` runs them, ``shard.stage.batch`` computes them).

A chunk that cannot run is a ``StageFailed`` for that chunk alone: the executor reports it as
a ``Fault`` for its session and the rest of the batch runs.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque

import attrs
import torch

from shard.compute.tensors import from_wire, to_wire
from shard.decode.verify import check_q
from shard.messages import (
    MAX_FEATURE_LAYERS,
    MAX_FEATURES,
    Hop,
    NodeName,
    OpenSession,
    Prefill,
    Sampling,
    SessionId,
    Verdict,
    Verify,
)
from shard.model.kvcache import KVCache
from shard.model.llama import StageModel
from shard.model.recurrent import ROLLBACK, layer_state_bytes
from shard.stage.batch import Answer, Carried, Planned, rows_of
from shard.stage.features import (
    FeatureWindow,
    StatesError,
    carried_rows,
    incoming_states,
    wire_dtype,
)
from shard.stage.tail_drafts import TailDrafts, TailSession, ids_refusal

#: Verify spacings a session's rhythm is the median of (``Session.period``).
RHYTHM_GAPS = 3

__all__ = [
    "RHYTHM_GAPS",
    "Session",
    "StageFailed",
    "chunk_input",
    "features_refusal",
    "is_replay",
    "output",
    "plan",
]


class StageFailed(Exception):
    """A chunk could not be computed; reported downstream as a ``Fault`` for that session."""

    def __init__(self, message: str, kind: str = "chunk") -> None:
        super().__init__(message)
        self.kind = kind


@attrs.define
class Session:
    """One session's state at this stage."""

    cache: KVCache
    sampling: Sampling
    written: int = 0  # positions [0, written) hold KV a later chunk may attend to
    queued_s: float = 0.0  # its chunks' total wait before their forward
    chunks: int = 0
    seen: float = -math.inf  # trio time of its newest chunk here (or its opening)
    verified: float = -math.inf  # trio time of its newest verify (decode) chunk here
    # its last RHYTHM_GAPS spacings of verify chunks here (older ones fall out)
    gaps: deque[float] = attrs.field(factory=lambda: deque(maxlen=RHYTHM_GAPS))
    features: FeatureWindow | None = None  # the tail's, when the session asked for features
    window: int = 0  # the session's feature window (``OpenSession.features``), every stage
    layers: tuple[int, ...] = ()  # its feature layers (global; ``OpenSession.feature_layers``)
    drafting: TailSession | None = None  # the tail's MTP drafts (``OpenSession.drafts``)

    @classmethod
    def opened(
        cls,
        msg: OpenSession,
        cache: KVCache,
        *,
        tail: bool,
        now: float,
        drafts: TailDrafts | None = None,
    ) -> Session:
        """The session ``msg`` opens at a stage (``tail``: the last, drafting with ``drafts``
        when the session asks for them), KV in ``cache``."""
        drafting = drafts.open(msg) if drafts is not None and tail else None
        size = drafts.window if drafting is not None and drafts is not None else msg.features
        window = FeatureWindow(size) if size and tail else None
        return cls(
            cache,
            msg.sampling,
            seen=now,
            features=window,
            window=msg.features,
            layers=msg.feature_layers,
            drafting=drafting,
        )

    @property
    def period(self) -> float:
        """The typical spacing of its verify chunks here: the median of its last
        ``RHYTHM_GAPS`` (inf before it has one). A median, not a running mean: a session's
        first spacings are far longer than its rhythm (a crowd of sessions starting together
        spends them on each other's prompts), and a mean carries them for a dozen laps — long
        enough that the rest of a wave is "not due" when it comes and the wave splits."""
        return statistics.median(self.gaps) if self.gaps else math.inf

    def arrived(self, now: float, *, verify: bool) -> None:
        """Note a chunk's arrival; a verify chunk also updates the spacing (prefill chunks
        come back to back once, so they say nothing about the session's rhythm)."""
        self.seen = now
        if not verify:
            return
        if math.isfinite(self.verified) and now >= self.verified:
            self.gaps.append(now - self.verified)  # the oldest falls out (maxlen)
        self.verified = now

    def due_by(self, deadline: float) -> bool:
        """Whether its next verify chunk is expected here by ``deadline``: one spacing after
        its last (never, before it has a spacing)."""
        return self.verified + self.period <= deadline


def plan(
    model: StageModel,
    node: NodeName,
    sessions: dict[SessionId, Session],
    msg: Prefill | Verify,
    arrived: float,
) -> Planned:
    """Check a chunk against its session and claim its positions (so a later chunk of the same
    session in this batch sees them written); ``StageFailed`` if it cannot run."""
    sess = sessions.get(msg.session)
    if sess is None:
        raise StageFailed(f"{node}: session {msg.session} is not open here", "gap")
    x = chunk_input(model, node, msg)
    n = int(x.shape[1])
    if msg.start < 0 or msg.start + n > sess.cache.max_len:
        raise StageFailed(
            f"{node}: positions [{msg.start}, {msg.start + n}) do not fit the "
            f"session's KV length {sess.cache.max_len}"
        )
    if msg.start > sess.written:
        raise StageFailed(
            f"{node}: session {msg.session} chunk at {msg.start} but only positions "
            f"< {sess.written} are written here (frames were lost)",
            "gap",
        )
    back = sess.written - msg.start  # positions written and now discarded
    if msg.start > 0 and back > ROLLBACK and len(model.layers) > model.n_attention:
        raise StageFailed(
            f"{node}: session {msg.session} chunk at {msg.start} rolls back {back} positions; "
            f"linear-attention layers keep their state {ROLLBACK} back at most: send the "
            "session again from its start",
            "gap",
        )
    if isinstance(msg, Verify) and len(msg.draft) >= n:
        raise StageFailed(f"{node}: {len(msg.draft)} drafted tokens in a chunk of {n} positions")
    if isinstance(msg, Prefill) and msg.tail_ids:
        if (why := ids_refusal(msg, n, model.config.vocab_size)) is not None:
            raise StageFailed(f"{node}: {why}")
        if sess.drafting is not None and not msg.replay:
            sess.drafting.prompt_chunk(msg, n)
    if isinstance(msg, Verify) and msg.q and model.is_last:
        why = check_q(msg.q, msg.draft, model.config.vocab_size)
        if why is not None:
            raise StageFailed(f"{node}: {why}")
    if not sess.layers:
        if msg.states is not None:
            raise StageFailed(f"{node}: layer states in a session that asked for none")
        sess.written = msg.start + n
        window = sess.features.size if sess.features is not None and model.is_last else 0
        return Planned(msg, x, sess.cache, sess.sampling, arrived, features=window)
    carry = carried_rows(msg, sess.window, n)
    try:
        states = incoming_states(
            msg.states,
            before=sum(layer < model.first for layer in sess.layers),
            rows=carry,
            dim=model.config.hidden_size,
            dtype=wire_dtype(model.dtype),
        )
    except StatesError as exc:
        raise StageFailed(f"{node}: {exc}") from exc
    sess.written = msg.start + n
    local = tuple(layer - model.first for layer in sess.layers if model.first <= layer < model.last)
    return Planned(
        msg, x, sess.cache, sess.sampling, arrived, layers=local, carry=carry, states=states
    )


def features_refusal(model: StageModel, msg: OpenSession) -> str | None:
    """Why this stage refuses the features an ``OpenSession`` asks for, or None: more rows
    than ``MAX_FEATURES``, or feature layers that are not strictly increasing layers of the
    model (at most ``MAX_FEATURE_LAYERS``, only with rows), or of a family whose residual
    stream is wider than one hidden vector (DeepSeek-V4's hyper-connections)."""
    if not 0 <= msg.features <= MAX_FEATURES:
        return (
            f"features {msg.features} not in [0, {MAX_FEATURES}]: a verdict carries at most "
            f"{MAX_FEATURES} rows of target features"
        )
    layers, c = msg.feature_layers, model.config
    if not layers:
        return None
    if not msg.features:
        return "feature_layers without features (rows) to return them in"
    increasing = all(a < b for a, b in itertools.pairwise(layers))
    if (
        len(layers) > MAX_FEATURE_LAYERS
        or not increasing
        or not 0 <= layers[0] <= layers[-1] < c.n_layers
    ):
        return (
            f"feature_layers {list(layers)}: at most {MAX_FEATURE_LAYERS} strictly increasing "
            f"layers in [0, {c.n_layers})"
        )
    if c.hidden_wire_width != c.hidden_size:
        return "this family's stages cannot capture layer states (its residual stream is wider)"
    return None


def output(
    msg: Prefill | Verify,
    out: torch.Tensor | Carried | Answer,
    hops: tuple[Hop, ...],
    features: FeatureWindow | None = None,
) -> Prefill | Verify | Verdict | None:
    """A planned chunk's message downstream: its hidden states, its ``Verdict`` (the tail),
    or None (a tail prefill chunk before the last). With the session's ``features`` window,
    the verdict carries the rows ``shard.stage.features`` says (a prompt chunk's rows are kept
    for the prompt's final verdict)."""
    if isinstance(out, Carried):
        states = None if out.states is None else to_wire(out.states[None])
        return attrs.evolve(msg, ids=(), hidden=to_wire(out.hidden), hops=hops, states=states)
    if isinstance(out, torch.Tensor):
        return attrs.evolve(msg, ids=(), hidden=to_wire(out), hops=hops, states=None)
    window = features if out.features is not None else None
    if window is not None and out.features is not None and isinstance(msg, Prefill):
        window.prompt_chunk(msg.start, rows_of(msg), out.features)
    if out.choice is None:
        return None
    target_ids, accepted = out.choice
    verdict = Verdict(
        session=msg.session,
        epoch=msg.epoch,
        seq=msg.seq,
        start=msg.start,
        target_ids=target_ids,
        accepted=accepted,
        hops=hops,
    )
    if window is None or out.features is None:
        return verdict
    if isinstance(msg, Prefill):
        first, rows = window.take_prompt()
    else:
        first, rows = window.verify(msg.start, accepted, out.features)
    return attrs.evolve(verdict, features=to_wire(rows), features_start=first)


def chunk_input(model: StageModel, node: NodeName, msg: Prefill | Verify) -> torch.Tensor:
    """The chunk's rows as a tensor on ``model``'s device, checked: ids ``[1, S]`` in the
    vocabulary (first stage), else hidden ``[1, S, D]`` in the block's dtype."""
    if model.is_first:
        if not msg.ids or msg.hidden is not None:
            raise StageFailed(f"{node}: the first stage needs token ids, got hidden")
        vocab = model.config.vocab_size
        if any(not 0 <= t < vocab for t in msg.ids):
            raise StageFailed(f"{node}: token id out of range [0, {vocab})")
        return torch.tensor([msg.ids], dtype=torch.int64, device=model.device)  # [1, S]
    if msg.hidden is None:
        raise StageFailed(f"{node}: a middle or tail stage needs hidden states")
    try:
        hidden = from_wire(msg.hidden, device=model.device)
    except ValueError as exc:
        raise StageFailed(f"{node}: bad hidden payload: {exc}") from exc
    if hidden.dtype != model.dtype:
        raise StageFailed(
            f"{node}: hidden states are {msg.hidden.dtype}, this block runs in "
            f"{model.dtype}; every stage of a swarm must use the spec's dtype"
        )
    dim = model.config.hidden_wire_width
    shape = tuple(hidden.shape)
    if len(shape) != 3 or shape[0] != 1 or shape[1] < 1 or shape[2] != dim:
        raise StageFailed(f"{node}: hidden shape {shape} is not [1, S >= 1, {dim}]")
    return hidden


def is_replay(msg: Prefill | Verify) -> bool:
    return isinstance(msg, Prefill) and msg.replay


def kv_refusal(model: StageModel, max_len: int, held: int, budget: int) -> str | None:
    """Why a session of ``max_len`` positions does not fit a KV ``budget`` (bytes) of which
    ``held`` is taken, or None if it fits."""
    elem = torch.empty((), dtype=model.dtype).element_size()
    need = model.n_attention * model.config.kv_elements * max_len * elem  # MLA: its latent
    n_linear = len(model.layers) - model.n_attention  # each keeps a state, whatever max_len
    need += n_linear * layer_state_bytes(model.config, elem)
    if held + need <= budget:
        return None
    mib = 1 << 20
    return (
        f"a session of {max_len} positions needs {need / mib:.1f} MiB of KV; "
        f"{held / mib:.1f} of {budget / mib:.1f} MiB (limits.kv_budget_mib) are held by open "
        "sessions: retry later or ask for a shorter max_len"
    )
