"""Stop strings, applied to text as it streams: across token boundaries, never leaking part
of a stop string.

Pure. ``StopText.push`` takes each new piece of decoded text and returns what is safe to send
now: text that cannot be the start of a stop string. A tail that might still become one is held
back until later text decides; when a stop string completes, everything before it is
returned and the rest of the generation is dropped (``hit``).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Cuts a text stream at the stop string that completes first (the one whose end comes
    earliest; of those ending together, the longest), as a generation that stops the moment
    a stop string appears would. That choice does not depend on how the text is split."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.hit = False

    def push(self, text: str) -> str:
        """Add ``text``; return what may be emitted now ("" once a stop string was hit)."""
        if self.hit:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        # (end, start) of each stop's first occurrence: the earliest end completed first.
        found = [(i + len(s), i) for s in self._stops if (i := buffer.find(s)) >= 0]
        if found:
            self.hit = True
            self._held = ""
            return buffer[: min(found)[1]]
        keep = max(self._partial(buffer, s) for s in self._stops)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The generation ended without completing a stop string: release what was held."""
        held, self._held = self._held, ""
        return "" if self.hit else held

    @staticmethod
    def _partial(buffer: str, stop: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of ``stop``."""
        for n in range(min(len(stop) - 1, len(buffer)), 0, -1):
            if buffer.endswith(stop[:n]):
                return n
        return 0
