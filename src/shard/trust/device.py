"""What machine computed a chunk: the GPU's UUID and name through NVML when there is one,
else a CPU fingerprint. Receipts carry it; it identifies, it does not prove.

``pynvml`` comes from the ``nvidia-ml-py`` package. Without an NVIDIA driver ``nvmlInit()``
raises ``NVMLError_LibraryNotFound`` (or another ``NVMLError``): that is the normal CPU case.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path


@functools.cache
def device_identity() -> str:
    """``gpu:<name>:<uuid>`` for GPU 0, or ``cpu:<model>:<machine fingerprint>``."""
    gpu = _gpu_identity()
    return gpu if gpu is not None else _cpu_identity()


def _gpu_identity() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver / no GPU: NVMLError_LibraryNotFound and friends
        return None
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        return f"gpu:{_text(name)}:{_text(uuid)}"
    except pynvml.NVMLError:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cpu_identity() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    machine = ""
    for path in (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id")):
        try:
            machine = path.read_text().strip()
            break
        except OSError:
            continue
    fingerprint = hashlib.blake2b(
        f"{machine}|{platform.node()}|{model}".encode(), digest_size=8
    ).hexdigest()
    return f"cpu:{model}:{fingerprint}"
