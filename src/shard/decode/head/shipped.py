"""Draft heads shipped inside the package: ``shipped_heads/<model>-eagle3/``, EAGLE-3 heads in
their published layout (``config.json`` + ``model.safetensors``, the target's embedding left
out), each with the ``train.json`` that says how it was made (``shard draft eagle3``).

A spec names one by its directory's name (``draft_head = "smollm2-eagle3"``); it is the
default EAGLE-3 head of the bundled model it was trained for. Pure (paths and JSON, no
torch), so the spec reader resolves names with it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ARCHITECTURES", "CONFIG_FILE", "SHIPPED", "is_eagle3_dir", "shipped_head"]

CONFIG_FILE = "config.json"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
"""What an EAGLE-3 head's ``config.json`` names as its architecture (SpecForge's, vLLM's)."""

SHIPPED = Path(__file__).parent / "shipped_heads"
_MAX_CONFIG_BYTES = 1 << 20


def shipped_head(name: str) -> Path | None:
    """The shipped head called ``name`` (``"smollm2-eagle3"``), or None."""
    if not name or "/" in name or name.startswith("."):
        return None
    path = SHIPPED / name
    return path if (path / CONFIG_FILE).is_file() else None


def is_eagle3_dir(path: Path) -> bool:
    """Whether ``path`` holds an EAGLE-3 head's ``config.json`` (its architectures say so).
    Anything unreadable is not one; loading it says what is wrong."""
    file = Path(path) / CONFIG_FILE
    try:
        if file.stat().st_size > _MAX_CONFIG_BYTES:
            return False
        d = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    archs = d.get("architectures") if isinstance(d, dict) else None
    return isinstance(archs, list) and bool(set(map(str, archs)) & set(ARCHITECTURES))
