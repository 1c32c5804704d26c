"""The coordinator's receipt log: every request it completes, signed, kept as a file.

With ``[ledger] receipts = DIR`` the coordinator gathers a signed receipt for every request
(every stage's, as ``--receipt`` asks for one), whoever sent it — a wire client, the HTTP API,
a resumed request — and writes its run receipt to ``DIR`` as ``shard receipt verify`` and
``shard ledger DIR`` read it. It is the operator's metering record: what each node computed,
for a payout system, with no client's cooperation needed.

A file is written whole or not at all (a temporary name, then a rename), named by when it was
signed and by its job (unique per run), so a restarted coordinator never overwrites one. A
write that fails (a full disk, a folder made read-only) is logged at error and does not fail
the request: the client has its output, and the log line says which receipt is missing.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from shard.compute import offload
from shard.trust.receipt_check import receipt_to_json
from shard.trust.receipts import RunReceipt

log = logging.getLogger(__name__)


class ReceiptLog:
    """Writes run receipts into ``folder`` (created if missing, at the first write)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.written = 0

    def path_of(self, receipt: RunReceipt) -> Path:
        """Where ``receipt`` goes: ``<UTC signing time>-<job>.receipt.json``."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(receipt.signed_at))
        return self.folder / f"{stamp}-{receipt.job[:32]}.receipt.json"

    async def keep(self, receipt: RunReceipt) -> Path | None:
        """Write ``receipt``; its path, or None when the write failed (logged)."""
        path = self.path_of(receipt)
        try:
            await offload.run_sync(_write, path, receipt_to_json(receipt))
        except OSError as exc:
            log.error("receipt log: could not write %s (job %s): %s", path, receipt.job, exc)
            return None
        self.written += 1
        return path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.part")
    part.write_text(text, encoding="ascii")
    os.replace(part, path)


__all__ = ["ReceiptLog"]
