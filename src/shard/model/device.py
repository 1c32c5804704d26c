"""A node's spec'd device and dtype as torch values, checked against this machine.

The spec only checks spelling (``shard.spec.device``); whether ``cuda:1`` exists is known only
on the machine a node starts on, so a node resolves its device here before loading anything,
and refuses one it cannot use with one line that says what to write instead.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs
import torch

__all__ = [
    "CudaProbe",
    "DeviceUnavailable",
    "cpu_has_bf16",
    "emulated_dtype_note",
    "resolve_device",
    "torch_dtype",
]

#: CPU flags (Linux ``/proc/cpuinfo``) of instructions that multiply bf16 natively.
BF16_FLAGS: Final = frozenset({"avx512_bf16", "amx_bf16"})

TORCH_DTYPES: Final = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class DeviceUnavailable(Exception):
    """A node's spec'd device does not exist on this machine. ``str()`` is one line."""


@attrs.frozen
class CudaProbe:
    """What this machine offers: torch's CUDA build, and the GPUs it sees (injected in tests)."""

    built: Callable[[], bool] = torch.backends.cuda.is_built
    available: Callable[[], bool] = torch.cuda.is_available
    count: Callable[[], int] = torch.cuda.device_count


def resolve_device(text: str, node: str, probe: CudaProbe | None = None) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (cuda:0 if a GPU is usable, else cpu).

    Errors: ``DeviceUnavailable`` for a CUDA device this machine cannot give (torch built
    without CUDA, no GPU visible, or fewer GPUs than ``N + 1``).
    """
    probe = probe if probe is not None else CudaProbe()
    if text == "cpu":
        return torch.device("cpu")
    usable = probe.available() and probe.count() > 0
    if text == "auto":
        return torch.device("cuda", 0) if usable else torch.device("cpu")
    if not text.startswith("cuda"):
        raise DeviceUnavailable(f'{node}: unknown device {text!r}; use "cpu", "cuda:N" or "auto"')
    index = int(text.partition(":")[2] or 0)
    fix = 'use device = "cpu" or "auto"'
    if not probe.built():
        why = "torch built without CUDA; install a CUDA build of torch, or"
        raise DeviceUnavailable(f"{node}: device cuda:{index} is not available ({why} {fix})")
    if not usable:
        why = "no GPU visible: check the NVIDIA driver and CUDA_VISIBLE_DEVICES"
        raise DeviceUnavailable(f"{node}: device cuda:{index} is not available ({why}); {fix}")
    count = probe.count()
    if index >= count:
        raise DeviceUnavailable(
            f"{node}: device cuda:{index} is not available (this machine has {count} GPU"
            f"{'s' if count != 1 else ''}: cuda:0..cuda:{count - 1}); {fix} or a lower index"
        )
    return torch.device("cuda", index)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name (``float32``, ``bfloat16``, ``float16``)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(TORCH_DTYPES)}") from None


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), from ``cpuinfo``'s
    flags; False where the file is missing or unreadable (not Linux). Without such
    instructions a bf16 product is emulated and slower than fp32; with them it is faster
    (docs/benchmarks.md, "bf16 on the CPU")."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return bool(BF16_FLAGS & set(value.split()))
    return False


def emulated_dtype_note(
    node: str, device: torch.device, dtype: torch.dtype, cpuinfo: Path = Path("/proc/cpuinfo")
) -> str | None:
    """One line to log where ``node`` runs bf16 on a CPU without bf16 instructions, else None.

    Such a CPU emulates a bf16 matrix product: on an AVX2-only host SmolLM2's three blocks
    took 2.1x as long in bf16 as in fp32 for a 16-row forward (0.86x for one row, which only
    reads half the bytes; docs/benchmarks.md, "Session 13"). The node still runs: the
    dtype decides its arithmetic, and the operator chose it.
    """
    if device.type != "cpu" or dtype is not torch.bfloat16 or cpu_has_bf16(cpuinfo):
        return None
    return (
        f"{node}: dtype bfloat16 on a CPU without bf16 instructions (no avx512_bf16 or "
        "amx_bf16 flag): its matrix products are emulated, so batched and multi-token "
        'forwards run slower than in float32 (measured 2.1x at 16 rows); dtype = "float32" '
        "runs them faster on this machine"
    )
