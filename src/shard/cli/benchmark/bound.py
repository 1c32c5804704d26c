"""The analytical bound of one benchmark run: what the ring could do at best, given what the
run itself measured (pure; docs/benchmarks.md writes the formulas out).

Per run, decode only (the prefill lap is excluded everywhere):

- ``n`` verified chunks committed ``N`` tokens: ``E = N / n`` tokens per chunk (per lap), with
  ``K = drafted / n`` drafts per chunk and ``α = accepted / drafted``;
- ``c_i``: stage i's compute per chunk as the run measured it: its service time, which in a
  pipelined run on one machine includes waiting for a core (and memory bandwidth) that
  another stage's chunk holds;
- ``a_i``: stage i's compute per chunk *alone*, from the same ring's D = 1 run of the prompt
  when that run sent the same chunks (the oracle at fixed K), else ``a_i = c_i``;
  ``A = Σ a_i``;
- ``Λ``: the emulated latency summed over the ring's edges; ``w``: what the edges cost beyond
  it per lap (serialization, sockets, relays), taken from a run with one chunk in flight, so
  that it holds no queueing;
- ``t_d``: the draft's seconds per drafted token (0 for n-gram and oracle);
- ``P``: the cores the stages share (all of them on one machine; 0 = a core each);
- the unloaded lap of one chunk: ``lap0 = Λ + A + w + K · t_d``.

Then, with ``D`` chunks in flight (1 for plain and spec)::

    steady state  rate = E / lap0                                    (D = 1)
                  rate = min(D·E / lap0, E / s, E / (K·t_d))         (D > 1)
                  where s = max(max c_i, A / P): the slowest stage, or the cores
    this request  time ≥ max(⌈n / D⌉ · lap0, lap0 + (n − 1) · s, n · K · t_d)

The second form is the same model for a request of ``n`` chunks: the pipeline starts empty
after the prefill and drains at the end, which a short request cannot amortise. Measured /
bound is then the engine's efficiency given the stages' service times: what it loses to
bubbles, scheduling and the coordinator. How much slower the stages got by sharing the
machine is a property of the deployment (three stages on two cores), reported beside it as
``contention = C / A``.
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen
class Measured:
    """One run's decode-only measurements (see the module docstring for the symbols)."""

    tokens: int  # N
    chunks: int  # n
    drafted: int
    accepted: int
    stage_chunk_s: tuple[float, ...]  # c_i
    latency_s: float  # Λ
    wire_s: float  # w
    draft_token_s: float  # t_d
    depth: int  # D
    cores: int = 0  # P (0: every stage has a core of its own)
    alone_chunk_s: tuple[float, ...] | None = None  # a_i (None: a_i = c_i)


@attrs.frozen
class Bound:
    """The bound of one run and the numbers it came from (rates in tokens per second)."""

    k: float
    alpha: float | None
    e: float  # measured tokens per chunk
    e_alpha: float | None  # (1 − α^(K+1)) / (1 − α) from the measured α and K
    lap0_s: float
    contention: float  # C / A: stage compute per chunk in this run over alone
    latency_rate: float  # D · E / lap0
    stage_rate: float | None  # E / s, s = max(max c_i, C / P) (only binds when D > 1)
    draft_rate: float | None  # E / (K · t_d)
    steady_tok_s: float
    limited_by: str  # "lap", "stage" or "draft"
    request_s: float  # the least decode time for this request's n chunks
    request_tok_s: float  # N / request_s


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a chunk of ``k`` i.i.d. drafts commits: (1 − α^(k+1)) / (1 − α)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - math.pow(alpha, k + 1.0)) / (1.0 - alpha)


def bound(m: Measured) -> Bound | None:
    """The bound of ``m``; None when the run decoded nothing (no chunk after the prefill)."""
    if m.chunks <= 0 or m.tokens <= 0 or not m.stage_chunk_s:
        return None
    k = m.drafted / m.chunks
    alpha = m.accepted / m.drafted if m.drafted else None
    e = m.tokens / m.chunks
    draft_s = k * m.draft_token_s
    alone = sum(m.alone_chunk_s or m.stage_chunk_s)
    slowest = max(max(m.stage_chunk_s), alone / m.cores if m.cores > 0 else 0.0)
    lap0 = m.latency_s + alone + max(m.wire_s, 0.0) + draft_s
    rates = {"lap": m.depth * e / lap0}
    if m.depth > 1:
        rates["stage"] = e / slowest
        if draft_s > 0:
            rates["draft"] = e / draft_s
    limited_by = min(rates, key=lambda name: rates[name])
    waves = math.ceil(m.chunks / m.depth) * lap0
    request_s = max(waves, lap0 + (m.chunks - 1) * slowest, m.chunks * draft_s)
    return Bound(
        k=k,
        alpha=alpha,
        e=e,
        e_alpha=expected_tokens(alpha, k) if alpha is not None else None,
        lap0_s=lap0,
        contention=sum(m.stage_chunk_s) / alone,
        latency_rate=rates["lap"],
        stage_rate=rates.get("stage"),
        draft_rate=rates.get("draft"),
        steady_tok_s=rates[limited_by],
        limited_by=limited_by,
        request_s=request_s,
        request_tok_s=m.tokens / request_s,
    )
