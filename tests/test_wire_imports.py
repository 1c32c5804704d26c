"""shard.wire stays light: importing it never pulls in torch (or numpy)."""

from __future__ import annotations

import subprocess
import sys


def test_import_wire_does_not_import_torch() -> None:
    """A fresh interpreter can import shard.wire without torch or numpy being imported."""
    code = (
        "import shard.wire, sys; "
        "assert 'torch' not in sys.modules, 'torch'; "
        "assert 'numpy' not in sys.modules, 'numpy'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
