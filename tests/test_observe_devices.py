"""GPU telemetry (``shard.observe.devices``) with a fake ``pynvml``: memory and utilisation
per GPU, "no NVIDIA driver" said once, unsupported readings shown as unknown; the snapshot
carries it through the wire codec and the monitor shows one line per GPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from shard.messages import DeviceStatus, NodeName, StatusSnapshot
from shard.observe.devices import DeviceProbe
from shard.observe.tui import state as st
from shard.observe.tui.app import summary_text
from shard.testing.snapshots import sample_snapshot

GIB = 1024**3


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # pynvml spells it so
    pass


class FakeNVML:
    """The slice of ``pynvml`` the probe uses: ``gpus`` is ``(name, used, total, util)``."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[tuple[Any, int, int, int | None]], *, driver: bool = True):
        self.gpus = gpus
        self.driver = driver
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if not self.driver:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> Any:
        return self.gpus[h][0]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=self.gpus[h][1], total=self.gpus[h][2], free=0)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        util = self.gpus[h][3]
        if util is None:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=util, memory=0)


def test_reads_every_gpu() -> None:
    """One ``DeviceStatus`` per GPU with its name (bytes or str), memory and utilisation."""
    nvml = FakeNVML([(b"NVIDIA H200", 12 * GIB, 140 * GIB, 45), ("NVIDIA L4", GIB, 24 * GIB, 0)])
    probe = DeviceProbe(NodeName("coord"), nvml=nvml)
    assert probe.read() == (
        DeviceStatus(NodeName("coord"), 0, "NVIDIA H200", 12 * GIB, 140 * GIB, 45),
        DeviceStatus(NodeName("coord"), 1, "NVIDIA L4", GIB, 24 * GIB, 0),
    )
    probe.read()
    assert nvml.inits == 1 and probe.available


def test_unsupported_utilisation_is_unknown_not_zero() -> None:
    """A GPU that cannot report utilisation (a MIG slice) shows None."""
    probe = DeviceProbe(NodeName("s0"), nvml=FakeNVML([("A100 MIG", 1, 2, None)]))
    assert probe.read()[0].utilization is None


def test_no_driver_is_said_once_and_reads_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Without a driver the probe logs "no NVIDIA driver" once, never raises, and stops asking."""
    nvml = FakeNVML([("x", 1, 2, 3)], driver=False)
    probe = DeviceProbe(NodeName("s0"), nvml=nvml)
    with caplog.at_level(logging.INFO, logger="shard.observe.devices"):
        assert probe.read() == ()
        assert probe.read() == ()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("s0: no NVIDIA driver (")
    assert nvml.inits == 1 and not probe.available


def test_the_real_pynvml_on_this_machine_never_raises() -> None:
    """Whatever this machine has (a GPU, or no driver at all), reading carries on."""
    readings = DeviceProbe(NodeName("here")).read()
    assert all(isinstance(d, DeviceStatus) for d in readings)


def test_the_monitor_shows_one_line_per_gpu() -> None:
    """The summary gains a line per reported GPU; without GPUs it is the two usual lines."""
    plain = sample_snapshot()
    assert len(summary_text(plain).plain.splitlines()) == 2
    gpu = DeviceStatus(NodeName("coord"), 0, "NVIDIA H200", 12 * GIB + GIB // 2, 140 * GIB, 45)
    unknown = DeviceStatus(NodeName("coord"), 1, "L4", 0, 24 * GIB, None)
    snap = StatusSnapshot(**{**_fields(plain), "devices": (gpu, unknown)})
    lines = summary_text(snap).plain.splitlines()
    assert lines[2] == "gpu0 coord NVIDIA H200  mem 12.5/140.0 GiB  util 45%"
    assert lines[3] == st.device(unknown) == "gpu1 coord L4  mem 0.0/24.0 GiB  util –"


def test_devices_cross_the_wire_in_the_snapshot() -> None:
    """A snapshot with devices survives the wire codec unchanged."""
    from shard.wire.frame import decode, encode

    device = DeviceStatus(NodeName("c"), 0, "g", 1, 2)
    snap = StatusSnapshot(**{**_fields(sample_snapshot()), "devices": (device,)})
    assert decode(encode(snap)) == snap


def _fields(snap: StatusSnapshot) -> dict[str, Any]:
    import attrs

    return attrs.asdict(snap, recurse=False)
