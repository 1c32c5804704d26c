"""Per-request checkpoints of committed tokens, so a restarted coordinator can resume.

The coordinator writes one small JSON file per running request (``<request>.json`` in the
checkpoint directory) each time tokens are committed — atomically: written to a temporary file,
then renamed — and deletes it when the request completes. A request that failed (``RingError``)
or whose coordinator died leaves its file behind; a coordinator loads it
(``CheckpointStore.pending``) and ``Coordinator.resume_request`` continues the request on the
(still warm) ring from the committed tokens. Sampling draws are keyed by position
(``shard.decode.verify``), so a resumed request draws exactly what the uninterrupted one would have.
A ``Checkpointer`` is one request's file: the driver records each commit in it directly.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs
import trio

from shard import strict_json
from shard.messages import ResumeRecord, Sampling

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: How long a live checkpoint stays resumable after its last save (a client that left without
#: an end, a standby's adopted request whose client never came back), and how many are kept
KEEP_S: Final = 600.0
MAX_LIVE: Final = 1024


class CheckpointError(Exception):
    """A checkpoint file cannot be read (names the file and what is wrong)."""


@attrs.frozen
class RequestCheckpoint:
    """A request as far as it got: the prompt, the committed output, and how to go on."""

    request: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    job: str = ""  # the job id of the request's first run, when it asked for a receipt
    ignore_eos: bool = False  # EOS does not end it (a benchmark's fixed length), resumed too

    def to_json(self) -> str:
        return json.dumps(
            {
                "request": self.request,
                "prompt_ids": list(self.prompt_ids),
                "output_ids": list(self.output_ids),
                "max_tokens": self.max_tokens,
                "sampling": attrs.asdict(self.sampling),
                **({"job": self.job} if self.job else {}),
                **({"ignore_eos": True} if self.ignore_eos else {}),
            }
        )

    @classmethod
    def from_json(cls, text: str, *, source: str) -> RequestCheckpoint:
        try:
            data = strict_json.loads(text, constants=True)  # no RecursionError, no key twice
            return cls(
                request=str(data["request"]),
                prompt_ids=tuple(int(t) for t in data["prompt_ids"]),
                output_ids=tuple(int(t) for t in data["output_ids"]),
                max_tokens=int(data["max_tokens"]),
                sampling=Sampling(**data["sampling"]),
                job=_job_id(data.get("job", "")),
                ignore_eos=_flag(data.get("ignore_eos", False)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{source}: not a request checkpoint: {exc!r}") from exc


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"ignore_eos {value!r} is not true or false")
    return value


def _job_id(value: object) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{32}|", value):
        raise ValueError(f"job {value!r} is not 32 lowercase hex digits")
    return value


def checkpoint_name(request: str) -> str:
    """``request`` if it can name a checkpoint. Errors: ``CheckpointError``."""
    if not _NAME.fullmatch(request):
        raise CheckpointError(f"request id {request!r}: use letters, digits, '_', '.', '-'")
    return request


class CheckpointStore:
    """A directory of request checkpoints (see the module docstring), and the running ones in
    memory (``live``), which a standby coordinator follows (``shard.coordinator.follow``).

    ``directory`` None: in memory only (a primary with a standby and no ``checkpoint_dir``).
    ``changed`` is set (and replaced) on every save and end: a follower waits on it.

    ``live`` is bounded: a request whose client left without an end (or an adopted one whose
    client never came back) stays resumable for ``keep_s`` after its last save, and at most
    ``max_live`` are kept (the least recently saved go first); each save sweeps. A running
    request that lost its entry gets it back, whole, at its next commit. Files in
    ``directory`` are not swept: they are what a restarted coordinator resumes (``pending``).
    """

    def __init__(
        self,
        directory: Path | None,
        *,
        keep_s: float = KEEP_S,
        max_live: int = MAX_LIVE,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._dir = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
        self.live: dict[str, RequestCheckpoint] = {}
        self.changed = trio.Event()
        self._keep_s, self._max_live, self._clock = keep_s, max_live, clock
        self._saved: dict[str, float] = {}  # request -> when last saved, oldest first

    def _sweep(self, now: float) -> None:
        """Drop live checkpoints saved over ``keep_s`` ago, and the oldest beyond
        ``max_live``."""
        for request, saved in list(self._saved.items()):
            if now - saved <= self._keep_s and len(self._saved) <= self._max_live:
                break  # oldest first: the rest are newer
            del self._saved[request]
            self.live.pop(request, None)
            log.info("checkpoint %s dropped: last saved %.0f s ago", request, now - saved)

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def adopt(self, checkpoints: Sequence[RequestCheckpoint]) -> None:
        """Take over requests another coordinator ran (a standby's followed ones): they are
        live here, and resumable (``get``), until they end."""
        for checkpoint in checkpoints:
            self.save(checkpoint)

    def get(self, request: str) -> RequestCheckpoint | None:
        """The live checkpoint of ``request``, if any."""
        return self.live.get(request)

    def _path(self, request: str) -> Path:
        checkpoint_name(request)
        return (self._dir or Path()) / f"{request}.json"

    def save(self, checkpoint: RequestCheckpoint) -> None:
        path = self._path(checkpoint.request)
        now = self._clock()
        self.live[checkpoint.request] = checkpoint
        self._saved.pop(checkpoint.request, None)  # to the end: the newest
        self._saved[checkpoint.request] = now
        self._sweep(now)
        self._changed()
        if self._dir is None:
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(checkpoint.to_json(), encoding="utf-8")
        os.replace(tmp, path)

    def done(self, request: str) -> None:
        path = self._path(request)
        self._saved.pop(request, None)
        if self.live.pop(request, None) is not None:
            self._changed()
        if self._dir is not None:
            path.unlink(missing_ok=True)

    def pending(self) -> list[RequestCheckpoint]:
        """Checkpoints left by requests that never ended (a coordinator died), oldest first."""
        if self._dir is None:
            return list(self.live.values())
        paths = sorted(self._dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        return [RequestCheckpoint.from_json(p.read_text(), source=str(p)) for p in paths]


class Checkpointer:
    """Keeps one running request's checkpoint current: ``commit`` adds the ids the driver
    just committed and rewrites the file (before the caller sees them), ``done`` removes it
    once the request completed. A resumed request's starts from the checkpoint it resumes
    (its committed ids are kept)."""

    def __init__(self, store: CheckpointStore, start: RequestCheckpoint) -> None:
        self._store = store
        self._checkpoint = start
        #: what a receipt of this run says it resumes (None for a request's first run)
        self.resumes = (
            ResumeRecord(start.request, start.job, len(start.output_ids))
            if start.job or start.output_ids
            else None
        )

    def pieces(self, total: int, chunk: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each prefill chunk of this run's ``total`` positions: the
        request's prompt in ``chunk`` pieces from 0, as its first run sent it, then a resumed
        run's committed output in pieces of at most ``ROWWISE_MAX_ROWS``. Its first run fed
        those tokens as decode steps (or verify chunks), and a quantized block gives a chunk
        that short its decode steps' bits (``Attention.rowwise``); one longer chunk would be
        attended at once, off by a bf16 step, enough to flip a near tie (the soak of issue 40
        got a wrong resumed stream so)."""
        from shard.model.attention import ROWWISE_MAX_ROWS

        prompt = min(len(self._checkpoint.prompt_ids), total)
        out = [(a, min(a + chunk, prompt)) for a in range(0, prompt, chunk)]
        out += [
            (a, min(a + ROWWISE_MAX_ROWS, total)) for a in range(prompt, total, ROWWISE_MAX_ROWS)
        ]
        return out

    def bind(self, job: str) -> None:
        """Note the job id of the request's first run that signs a receipt, so a coordinator
        that resumes the request names it in its own receipt (kept across resumes)."""
        if not self._checkpoint.job:
            self._checkpoint = attrs.evolve(self._checkpoint, job=job)
            self._store.save(self._checkpoint)

    @classmethod
    def fresh(
        cls,
        store: CheckpointStore,
        request: str,
        prompt_ids: Sequence[int],
        max_tokens: int,
        sampling: Sampling,
        ignore_eos: bool = False,
    ) -> Checkpointer:
        prompt = tuple(int(t) for t in prompt_ids)
        start = RequestCheckpoint(request, prompt, (), max_tokens, sampling, ignore_eos=ignore_eos)
        return cls(store, start)

    def begin(self) -> None:
        """Save the request as it starts, before its first token (a standby coordinator
        knows it then); called on the request's own path, so a failed write is its error."""
        self._store.save(self._checkpoint)

    def commit(self, ids: Sequence[int]) -> None:
        done = (*self._checkpoint.output_ids, *ids)
        self._checkpoint = attrs.evolve(self._checkpoint, output_ids=done)
        self._store.save(self._checkpoint)

    def done(self) -> None:
        self._store.done(self._checkpoint.request)
