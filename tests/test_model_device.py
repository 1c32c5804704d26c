"""A node's device and dtype: resolving ``cpu``/``cuda:N``/``auto`` against what the machine
has (faked), one-line refusals, weights loaded onto the device in the dtype, fp32 choices."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shard.compute.tensors import from_wire, to_wire
from shard.model.device import (
    CudaProbe,
    DeviceUnavailable,
    cpu_has_bf16,
    emulated_dtype_note,
    resolve_device,
    torch_dtype,
)
from shard.model.loader import load_stage

NO_BUILD = CudaProbe(built=lambda: False, available=lambda: False, count=lambda: 0)
NO_GPU = CudaProbe(built=lambda: True, available=lambda: False, count=lambda: 0)
TWO_GPUS = CudaProbe(built=lambda: True, available=lambda: True, count=lambda: 2)


def test_cpu_is_always_the_cpu() -> None:
    """``cpu`` never asks the machine anything."""
    probe = CudaProbe(built=pytest.fail, available=pytest.fail, count=pytest.fail)
    assert resolve_device("cpu", "s0", probe) == torch.device("cpu")


def test_auto_is_cuda_when_there_is_a_gpu_else_cpu() -> None:
    """``auto``: cuda:0 where a GPU is usable, else the CPU (no error either way)."""
    assert resolve_device("auto", "s0", TWO_GPUS) == torch.device("cuda", 0)
    assert resolve_device("auto", "s0", NO_GPU) == torch.device("cpu")
    assert resolve_device("auto", "s0", NO_BUILD) == torch.device("cpu")


def test_cuda_indices_resolve_on_a_machine_with_them() -> None:
    """``cuda`` is cuda:0; ``cuda:N`` is itself while N < the GPU count."""
    assert resolve_device("cuda", "s0", TWO_GPUS) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", "s0", TWO_GPUS) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("device", "probe", "why"),
    [
        ("cuda", NO_BUILD, "s1: device cuda:0 is not available (torch built without CUDA;"),
        ("cuda:0", NO_GPU, "s1: device cuda:0 is not available (no GPU visible:"),
        ("cuda:2", TWO_GPUS, "s1: device cuda:2 is not available (this machine has 2 GPUs:"),
    ],
)
def test_an_unusable_cuda_device_is_refused_in_one_line(
    device: str, probe: CudaProbe, why: str
) -> None:
    """The refusal names the node and device, says why, and what to write instead."""
    with pytest.raises(DeviceUnavailable) as info:
        resolve_device(device, "s1", probe)
    text = str(info.value)
    assert text.startswith(why)
    assert 'use device = "cpu" or "auto"' in text
    assert "\n" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_this_machine_refuses_cuda() -> None:
    """On a CPU-only machine (CI) the real probe refuses ``cuda`` and ``auto`` is the CPU."""
    with pytest.raises(DeviceUnavailable, match="s1: device cuda:0 is not available"):
        resolve_device("cuda", "s1")
    assert resolve_device("auto", "s1") == torch.device("cpu")


def test_torch_dtype_names() -> None:
    """The spec's dtype names map to torch dtypes; anything else is a ValueError."""
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float16") is torch.float16
    assert torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        torch_dtype("int8")


def test_load_stage_onto_a_device_in_a_dtype(tiny_checkpoint: Callable[..., Path]) -> None:
    """Weights and rotary tables land on the device asked for; weights in the dtype asked
    for; the tail's logits are fp32 whatever the block computes in."""
    model = load_stage(
        tiny_checkpoint(arch="llama"), 0, 4, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    assert model.dtype is torch.bfloat16 and model.device == torch.device("cpu")
    assert all(p.dtype is torch.bfloat16 for p in model.parameters())
    assert model.rope_cos.device == model.device
    logits = model(torch.tensor([[3, 4, 5]]), 0, model.new_cache(8))
    assert logits.dtype is torch.float32


def test_from_wire_builds_on_the_device_asked_for() -> None:
    """``from_wire(w, device)`` round-trips values and dtype onto ``device``."""
    t = torch.randn(1, 3, 8).to(torch.bfloat16)
    back = from_wire(to_wire(t), device=torch.device("cpu"))
    assert back.device == torch.device("cpu") and back.dtype is torch.bfloat16
    assert torch.equal(back, t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_stage_straight_onto_cuda(tiny_checkpoint: Callable[..., Path]) -> None:
    """On a GPU: every parameter and buffer is on cuda:0 and the forward runs there."""
    model = load_stage(tiny_checkpoint(arch="llama"), 0, 4, dtype=torch.bfloat16, device="cuda:0")
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(b.device.type == "cuda" for b in model.buffers())
    ids = torch.tensor([[3, 4, 5]], device="cuda:0")
    logits = model(ids, 0, model.new_cache(8))
    assert logits.device.type == "cuda" and logits.dtype is torch.float32


def test_cpu_has_bf16_reads_the_flags(tmp_path: Path) -> None:
    """bf16 instructions are read from ``cpuinfo``'s flags line (AVX512-BF16 or AMX); a CPU
    without them, a file without flags, and no file at all (not Linux) say no."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n")
    assert cpu_has_bf16(info)
    info.write_text("flags\t\t: fpu sse2 amx_tile amx_bf16\n")
    assert cpu_has_bf16(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert not cpu_has_bf16(info)
    info.write_text("processor\t: 0\n")
    assert not cpu_has_bf16(info)
    assert not cpu_has_bf16(tmp_path / "missing")


def test_bf16_on_a_cpu_without_bf16_instructions_gets_a_note(tmp_path: Path) -> None:
    """A node that runs bf16 on a CPU lacking avx512_bf16/amx_bf16 is told it is emulated (and
    what to write instead); fp32, a bf16 CPU and a GPU device get no note."""
    plain = tmp_path / "avx2"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n")
    native = tmp_path / "bf16"
    native.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    cpu = torch.device("cpu")
    note = emulated_dtype_note("s1", cpu, torch.bfloat16, plain)
    assert note is not None and note.startswith("s1: dtype bfloat16") and '"float32"' in note
    assert "\n" not in note
    assert emulated_dtype_note("s1", cpu, torch.float32, plain) is None
    assert emulated_dtype_note("s1", cpu, torch.bfloat16, native) is None
    assert emulated_dtype_note("s1", torch.device("cuda", 0), torch.bfloat16, plain) is None
