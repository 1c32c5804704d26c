"""The C++ extension (``native_step.cpp``: the native forward, ``shard.model.native``;
``native_q8.cpp``: the q8 product, ``shard.model.q8``; ``native_attn.cpp``: row attention,
``shard.model.rowattn``), compiled on first use and loaded.

It is compiled on first use with the host's C++ compiler (``$CXX``,
else ``c++``) against the installed torch, ~40 s, into ``$SHARD_NATIVE_DIR`` (else
``cache_dir()/native``), keyed by the sources, torch, Python and compiler, under a file lock
(a local swarm's stages start together), and loaded from there afterwards. Without a
compiler, or when the build fails, ``build`` says why and its users fall back to torch (a
warning says so): the same bytes, slower. It is built with OpenMP (torch's own ``libgomp``, by
its soname) so the q8 kernel shares torch's threads.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Final

import torch

from shard.model.cachedir import cache_dir

__all__ = ["build", "enabled", "main", "native_dir"]

log = logging.getLogger(__name__)

SOURCE: Final = Path(__file__).with_name("native_step.cpp")
#: Every source compiled into the extension (``native_q8.cpp``: the q8 product;
#: ``native_attn.cpp``: row attention).
SOURCES: Final = (SOURCE, SOURCE.with_name("native_q8.cpp"), SOURCE.with_name("native_attn.cpp"))
#: Seconds a build may take before it counts as failed.
BUILD_TIMEOUT_S: Final = 900.0
#: ``shard.logs.NOTE``, the level the CLI shows by default (``shard.model`` imports no other
#: shard package): a node that builds the extension says why its load takes ~40 s longer.
NOTE: Final = 25


def native_dir() -> Path:
    """Where built extensions live: ``$SHARD_NATIVE_DIR``, else ``cache_dir()/native``."""
    base = os.environ.get("SHARD_NATIVE_DIR")
    return Path(base) if base else cache_dir() / "native"


def enabled() -> bool:
    """False when ``SHARD_NATIVE`` is ``0``, ``off``, ``false`` or ``no`` (the native forward
    only: the q8 product uses the extension wherever it builds)."""
    return os.environ.get("SHARD_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


def _command(cxx: str, name: str, out: Path, openmp: bool = True) -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    includes = [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"]
    # no -march=native: the bytes never depend on the instruction set (the C++ file), and a
    # build in a shared cache folder then runs on any x86-64 or arm64 host of its kind
    return [
        cxx, "-O3", "-ffp-contract=off", *(["-fopenmp"] if openmp else []), "-fPIC", "-shared",
        "-std=c++20",
        f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(arg for p in includes for arg in ("-isystem", str(p))),
        "-isystem", sysconfig.get_paths()["include"],
        *(str(p) for p in SOURCES), "-o", str(out),
        f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python",
        f"-Wl,-rpath,{root / 'lib'}",
    ]  # fmt: skip


def _key(cxx: str) -> str:
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    for part in (torch.__version__, sys.version, cxx, sysconfig.get_config_var("EXT_SUFFIX")):
        h.update(str(part).encode())
    h.update(" ".join(_command(cxx, "x", Path("x"))).encode())
    return h.hexdigest()[:16]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def build() -> ModuleType | str:
    """The extension module, built on first use (module docstring); or why there is none.
    Once per process: a later call returns the same answer."""
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    key = _key(cxx)
    name = f"shard_native_{key}"
    folder = native_dir() / key
    path = folder / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it now
            if not path.exists():
                _compile(cxx, name, path)
        return _load(name, path)
    except (OSError, ImportError, subprocess.SubprocessError, RuntimeError) as exc:
        return f"the build failed: {exc}"


def _compile(cxx: str, name: str, path: Path) -> None:
    log.log(NOTE, "building the native extension into %s (once, ~40 s)", path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        failed = ""
        for openmp in (True, False):  # a compiler without OpenMP (clang without libomp)
            done = subprocess.run(
                _command(cxx, name, Path(tmp), openmp),
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if done.returncode == 0:
                break
            tail = (done.stderr or done.stdout).strip().splitlines()[-6:] or ["no output"]
            failed = failed or f"{cxx} exited {done.returncode}: " + " | ".join(tail)
            if openmp:
                log.log(
                    NOTE,
                    "building with OpenMP failed; trying without (int8 products on one thread)",
                )
        else:
            raise RuntimeError(failed)
        os.replace(tmp, path)  # whole or absent: a reader never sees half a library
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def main() -> int:
    """``python -m shard.model.native_build``: build the extension now (``ops/bootstrap`` does,
    so that no stage's first load waits ~40 s for it) and say where it is, or why there is
    none. Exits 0 either way: without it, stages and int8 products run in torch."""
    got = build()
    print(
        f"native extension: {got}" if isinstance(got, str) else f"native extension: {got.__file__}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
