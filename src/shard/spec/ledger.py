"""``[ledger]``: the coordinator's metering record (``shard.coordinator.receipt_log``).

```toml
[ledger]
receipts = "receipts"   # every request signed and its run receipt kept here (optional)
```

A relative folder resolves against the spec's directory. ``shard ledger DIR`` turns the folder
into what each node computed (docs/security.md, "The metering ledger").
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import attrs

from shard.spec.validate import Table

LEDGER_KEYS: Final = ("receipts",)


@attrs.frozen
class LedgerSpec:
    """``receipts``: the folder (absolute) the coordinator keeps every run receipt in; None:
    receipts only for clients that ask (``--receipt``)."""

    receipts: str | None = None


def read_ledger(table: Table, base_dir: Path | None = None) -> LedgerSpec:
    """Validate ``[ledger]`` (absent: no receipt log)."""
    if table.raw("receipts", None) is None:
        return LedgerSpec()
    path = Path(table.string("receipts", example='"receipts"')).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    return LedgerSpec(receipts=str(path))


__all__ = ["LEDGER_KEYS", "LedgerSpec", "read_ledger"]
