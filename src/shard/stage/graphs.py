"""CUDA graphs for a stage's forward: one capture per (session cache, chunk rows), replayed.

A small chunk (decode: 1 row; verify: K+1 rows) on a GPU spends most of its time launching
kernels, not running them. A captured ``torch.cuda.CUDAGraph`` replays the whole block's
kernels in one launch. A graph bakes in every address and shape it touched, so each one owns
static input buffers (the rows, their positions ``[S]``), writes the session's own static KV
cache (``shard.model.kvcache``: preallocated once, never moved) and leaves its result in a
static output. The forward it captures is ``StageModel.forward_at``, whose shapes depend on
the row count and the cache's length only, never on the chunk's position, so one capture
replays at every position of that session.

``ChunkGraphs`` decides, per chunk, graph or eager:

- ``off``, or a stage not on CUDA (and no capturer injected): every chunk runs
  ``StageModel.forward``, exactly as without this module;
- otherwise every chunk runs ``forward_at``: replayed from a graph when its row count is one
  of the shapes in use (decode, verify) and fewer than ``max_graphs`` exist, else eagerly
  (prefill chunks, a request's own K). So the arithmetic never depends on which chunks happened
  to be graphed — graphed and eager ``forward_at`` agree bit for bit, which is what a GPU
  checks (``tests/test_stage_graphs.py``);
- ``lazy``: a shape's first chunk in a session captures (its warm-up runs compute the real
  chunk, so nothing is computed twice in vain), later ones replay;
- ``warm``: every shape in use is captured when the session opens, before its first chunk,
  on dummy rows at positions ``[0, S)``; the cache is zeroed after, so no trace remains.

A tail chunk whose session asked for features (``OpenSession.features``) runs eagerly
(``with_features``): ``forward_at`` (or ``forward`` when ``off``), the same arithmetic as its
graph, returning the final norm's output beside the logits. A captured graph's static output
holds the logits only, and one more static buffer per graph for a few sessions' features is
not worth its memory yet; so such a session pays the eager launch cost on a GPU (counted in
``GraphStatistics.eager``), and its output is what its graph would give.

The capturer is injected: ``cuda_capture`` on a GPU; tests on a CPU inject one that runs the
function eagerly, which exercises the shape-keyed cache, the static buffers and the fallback
decision without a GPU. Runs in the forward's worker thread (``shard.compute.offload``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import attrs
import torch
from torch import Tensor

from shard.model.kvcache import KVCache
from shard.model.llama import StageModel, TailOut

__all__ = ["Capturer", "ChunkGraphs", "GraphStatistics", "chunk_rows", "cuda_capture"]

#: Replays of a captured graph: runs it and returns its (static) output.
Replay = Callable[[], Tensor]
#: Graphs kept at most per stage; past it, new (session, rows) keys run eagerly.
DEFAULT_MAX_GRAPHS = 256


class Capturer(Protocol):
    """Captures ``fn`` (which reads only static buffers) and returns its replay."""

    def __call__(self, fn: Callable[[], Tensor]) -> Replay: ...


def chunk_rows(k: int | None, k_max: int) -> frozenset[int]:
    """The row counts the ring sends for a K policy: decode (1) and verify (K+1 per K in use;
    every K in ``1..k_max`` when K adapts, ``k`` None)."""
    ks = [k] if k is not None else range(1, k_max + 1)
    return frozenset({1, *(kk + 1 for kk in ks if kk > 0)})


def cuda_capture(warmup: int = 2) -> Capturer:
    """The real capturer: ``warmup`` eager runs on a side stream (cuBLAS and the caching
    allocator settle), then one capture into a memory pool shared by this stage's graphs
    (safe: replays never overlap, and each output is copied out before the next)."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], Tensor]) -> Replay:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> Tensor:
            graph.replay()
            return out

        return replay

    return capture


@attrs.frozen
class GraphStatistics:
    """Graphs held, captures made, chunks replayed and chunks run eagerly since start."""

    graphs: int
    captures: int
    replays: int
    eager: int


@attrs.define
class _Graph:
    x: Tensor  # the chunk's rows: ids [1, S] or hidden [1, S, D]
    pos: Tensor  # their positions [S], int64
    replay: Replay


class ChunkGraphs:
    """A stage's forward, graphed per (session cache, rows) where it can be (module docstring).

    ``__call__(x, start, cache)`` is a drop-in for ``StageModel.__call__``; the caller has
    checked that ``[start, start+S)`` fits ``cache``. ``opened`` (warm) and ``forget`` follow
    the session's life. Errors: whatever the forward raises; a failed capture propagates.
    """

    def __init__(
        self,
        model: StageModel,
        *,
        mode: str,
        rows: Collection[int],
        capture: Capturer | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
    ) -> None:
        if mode not in ("off", "lazy", "warm"):
            raise ValueError(f"unknown graphs mode {mode!r}; use off, lazy or warm")
        on_cuda = model.device.type == "cuda"
        if not model.static_positions:  # a family without forward_at (DeepSeek-V4) runs eager
            mode = "off"
        if capture is None and on_cuda and mode != "off":
            capture = cuda_capture()
        self._model = model
        self._mode = mode if capture is not None else "off"
        self._rows = frozenset(rows)
        self._capture = capture
        self._max_graphs = max_graphs
        # Keyed by the cache's id: safe, because each graph's closure holds its cache, so the
        # id cannot be reused until ``forget`` drops the graph.
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._captures = 0
        self._replays = 0
        self._eager = 0

    @property
    def mode(self) -> str:
        """The mode in force: ``off`` whenever there is nothing to capture with (a CPU)."""
        return self._mode

    def statistics(self) -> GraphStatistics:
        return GraphStatistics(len(self._graphs), self._captures, self._replays, self._eager)

    def graphed(self, rows: int, cache: KVCache) -> bool:
        """Whether a chunk of ``rows`` into ``cache`` replays (or captures) a graph."""
        if self._mode == "off" or rows not in self._rows:
            return False
        return (id(cache), rows) in self._graphs or len(self._graphs) < self._max_graphs

    def __call__(self, x: Tensor, start: int, cache: KVCache) -> Tensor:
        rows = int(x.shape[1])
        if not self.graphed(rows, cache):
            return self.eager(x, start, cache)
        graph = self._graphs.get((id(cache), rows))
        if graph is None:
            graph = self._new(x, start, cache)
        else:
            self._load(graph, x, start)
        self._replays += 1
        return graph.replay().clone()

    def eager(self, x: Tensor, start: int, cache: KVCache) -> Tensor:
        """The chunk eagerly, with the arithmetic of ``__call__`` (a chunk whose layer states
        are captured: a graph's replay runs no forward hook)."""
        self._eager += 1
        if self._mode == "off":
            return self._model(x, start, cache)
        return self._model.forward_at(x, _positions(start, int(x.shape[1]), x.device), cache)

    def with_features(self, x: Tensor, start: int, cache: KVCache, feature_rows: int) -> TailOut:
        """The tail's chunk eagerly, with the final norm's output at its last ``feature_rows``
        (module docstring): the arithmetic of ``__call__``, never a graph."""
        self._eager += 1
        if self._mode == "off":
            return self._model(x, start, cache, feature_rows=feature_rows)
        rows = int(x.shape[1])
        return self._model.forward_at(
            x, _positions(start, rows, x.device), cache, feature_rows=feature_rows
        )

    def opened(self, cache: KVCache) -> None:
        """A session opened with this cache: under ``warm``, capture every shape in use now."""
        if self._mode != "warm":
            return
        first = self._model.is_first
        dim = self._model.config.hidden_wire_width
        for rows in sorted(self._rows):
            if rows > cache.max_len or not self.graphed(rows, cache):
                continue
            shape = (1, rows) if first else (1, rows, dim)
            dtype = torch.int64 if first else self._model.dtype
            self._new(torch.zeros(shape, dtype=dtype, device=self._model.device), 0, cache)
        cache.k.zero_()  # the captures' warm-ups wrote dummy K/V at [0, rows)
        cache.v.zero_()

    def forget(self, cache: KVCache) -> None:
        """The session using ``cache`` ended: drop its graphs (their buffers and its KV)."""
        for key in [key for key in self._graphs if key[0] == id(cache)]:
            del self._graphs[key]

    def _new(self, x: Tensor, start: int, cache: KVCache) -> _Graph:
        assert self._capture is not None
        rows = int(x.shape[1])
        static = _Graph(
            x=x.clone(),
            pos=_positions(start, rows, x.device),
            replay=lambda: torch.empty(0),
        )
        model = self._model
        static.replay = self._capture(lambda: model.forward_at(static.x, static.pos, cache))
        self._graphs[(id(cache), rows)] = static
        self._captures += 1
        return static

    @staticmethod
    def _load(graph: _Graph, x: Tensor, start: int) -> None:
        graph.x.copy_(x)
        graph.pos.copy_(_positions(start, int(graph.pos.shape[0]), graph.pos.device))


def _positions(start: int, rows: int, device: torch.device) -> Tensor:
    return torch.arange(start, start + rows, device=device)  # [S], int64
