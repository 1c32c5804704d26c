"""GPU telemetry through NVML (``pynvml``, from ``nvidia-ml-py``): memory and utilisation of
each GPU this node's process can see, for the status feed and the monitor.

Without an NVIDIA driver ``nvmlInit()`` raises ``NVMLError_LibraryNotFound`` — the normal CPU
case: the probe says "no NVIDIA driver" once (a log line) and reads nothing after, never
raising. NVML is initialised once for the process's life (device identity,
``shard.trust.device``, does its own short init/shutdown). The module is injected, so tests
drive every path with a fake.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from shard.messages import DeviceStatus, NodeName

log = logging.getLogger(__name__)


class DeviceProbe:
    """Reads ``DeviceStatus`` for every visible GPU; ``()`` where there is no NVML.

    ``nvml`` is the ``pynvml`` module (imported on first read when None). Errors: none
    escape; NVML failures are logged (once for "no driver", once per failing call kind).
    """

    def __init__(self, node: NodeName, *, nvml: ModuleType | Any | None = None) -> None:
        self._node = node
        self._nvml: Any = nvml  # pynvml is untyped: Any, whether the real module or a fake
        self._state = "new"  # new -> ready | absent
        self._warned: set[str] = set()

    @property
    def available(self) -> bool:
        """Whether NVML answered (False before the first ``read`` and without a driver)."""
        return self._state == "ready"

    def read(self) -> tuple[DeviceStatus, ...]:
        if self._state == "new":
            self._start()
        if self._state != "ready":
            return ()
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self._warn("count", f"cannot count GPUs: {exc}")
            return ()
        return tuple(d for i in range(count) if (d := self._device(i)) is not None)

    def _start(self) -> None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                log.info("%s: no GPU telemetry (pynvml is not installed)", self._node)
                self._state = "absent"
                return
            self._nvml = pynvml
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            log.info("%s: no NVIDIA driver (%s); no GPU telemetry", self._node, exc)
            self._state = "absent"
            return
        self._state = "ready"

    def _device(self, index: int) -> DeviceStatus | None:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = nvml.nvmlDeviceGetName(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        except nvml.NVMLError as exc:
            self._warn("device", f"cannot read GPU {index}: {exc}")
            return None
        try:
            utilization: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:  # not supported on some devices (MIG slices): unknown, not 0
            utilization = None
        return DeviceStatus(
            node=self._node,
            index=index,
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_used=int(memory.used),
            memory_total=int(memory.total),
            utilization=utilization,
        )

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s: %s", self._node, text)
