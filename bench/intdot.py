"""An integer-dot kernel for stored int4/int8 weights against torch's, shape by shape (issue 42).

An experiment, not shard's forward: ``bench/intdot/intdot.c`` quantizes each activation row
per block of 32 columns to int8 and multiplies it with the stored codes by integer dot
products (AVX-512 VNNI where the CPU has it, plain loops elsewhere), as llama.cpp does, with
every float step fixed (the C file's comment) so that its bytes can be defined by an eager
torch twin, ``reference`` here. The script:

1. builds the C file with the host's C compiler (``cc``, ``-O3 -march=native -fopenmp
   -ffp-contract=off``) into the cache folder (``shard.convert.bundled.cache_dir()/intdot``);
2. checks its bytes: on random weights of several shapes (int4 with and without offsets,
   int8, groups of 32 to 128, row counts 1, 3 and 9) it compares the kernel with the eager
   reference, its plain loops with its VNNI ones, 2 threads with 1, a row alone with the
   same row among others, and scales given as halves with the same scales as floats, and
   records how many of each were equal byte for byte;
3. times it against the kernels shard runs today (``QuantLinear``: torch's int4 kernel in
   bf16, ``int8-group``, the q8 product, for Q8_0) on every product shape of the two bundled
   models (q/k/v joined, o, gate/up joined, down, the tied head), random codes of the stored
   formats, one and nine rows, 1 and 2 threads, medians of ``--runs`` after 3 warm-ups; and
   sums them per decode step (layers times the four body products, plus the head). Those are
   cache-hot: one weight called again and again;
4. times a call of a 16 x 32 product (``call_us``: the fixed cost of a call through ctypes);
5. times whole decode steps in the model (``--steps`` one-row steps after 10 untimed, the
   median, ``--reps`` times interleaved): each bundled model loaded twice as stored, both
   with siblings unjoined (the kernel takes one weight a call), one as loaded and one with
   every int4 and int8 product of groups of 32 swapped for the kernel (called through
   ctypes, its input cast to float32); every weight read once a step, as a stage reads it.

Writes ``bench/results/intdot.json``: the checks, every timing, the load average before and
after. A benchmark, not a test: nothing here asserts. Run it alone: every figure shares this CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from plain_ring import REPO, git_info, machine_info
from quant_bench import timed_ms

Record = dict[str, Any]
SOURCE = REPO / "bench" / "intdot" / "intdot.c"
HALF_SCALES = 0x100  # intdot.c: a kind flag, scales and offsets given as halves
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared"]

#: Per bundled model: layers, and each product as (name, out, in, kind, offset, per layer):
#: SmolLM2-135M Q4_1 (int4 with offsets, groups of 32; Q8_0 head) and Gemma 3 270M Q4_K_M
#: (its Q4_K products as int4 with offsets, groups of 32; its Q6_K down projections, which no
#: int4 or int8 kernel here takes, left out; Q8_0 head).
MODELS: dict[str, tuple[int, list[tuple[str, int, int, int, bool]]]] = {
    "smollm2": (
        30,
        [
            ("qkv", 960, 576, 4, True),
            ("o", 576, 576, 4, True),
            ("gate_up", 3072, 576, 4, True),
            ("down", 576, 1536, 4, True),
            ("head", 49152, 576, 8, False),
        ],
    ),
    "gemma3-270m": (
        18,
        [
            ("qkv", 1536, 640, 4, True),
            ("o", 640, 1024, 4, True),
            ("gate_up", 4096, 640, 4, True),
            ("head", 262144, 640, 8, False),
        ],
    ),
}
CHECK_SHAPES = [
    (576, 576, 32, 4, True),
    (1536, 576, 32, 4, True),
    (576, 1536, 64, 4, False),
    (48, 128, 128, 4, True),
    (33, 224, 32, 4, True),
    (200, 96, 32, 8, False),
    (64, 160, 32, 8, True),
    (17, 64, 64, 8, False),
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="smollm2,gemma3-270m", help="comma-separated (MODELS)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rows", default="1,9", help="comma-separated row counts")
    p.add_argument("--runs", type=int, default=30, help="timed calls per figure (median)")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps in the model")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions in the model")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "intdot.json")
    return p.parse_args(argv)


def compiled(source: Path = SOURCE) -> Path:
    """``source`` (a C file of ``bench/intdot/``, which it may include) compiled once per the
    folder's sources and flags into the cache folder: the shared library's path."""
    from shard.convert.bundled import cache_dir

    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise SystemExit("no C compiler (cc, or $CC): this experiment needs one")
    sources = b"".join(f.read_bytes() for f in sorted(source.parent.glob("*.c")))
    key = hashlib.sha256(sources + " ".join([cc, *FLAGS, source.name]).encode()).hexdigest()
    lib = cache_dir() / "intdot" / key[:16] / f"{source.stem}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(".tmp")
        cmd = [cc, *FLAGS, "-I", str(source.parent), "-o", str(tmp), str(source), "-lm"]
        subprocess.run(cmd, check=True)
        tmp.replace(lib)
    return lib


def build() -> ctypes.CDLL:
    """The kernel (``compiled``), its entry points typed."""
    lib = compiled()
    so = ctypes.CDLL(str(lib))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    so.intdot_mm.argtypes = [p, i64, i64, p, ctypes.c_int, p, p, i64, i64, p, ctypes.c_int]
    so.intdot_mm.argtypes.append(ctypes.c_int)
    so.intdot_mm.restype = ctypes.c_int
    return so


def native(
    so: ctypes.CDLL,
    x: torch.Tensor,
    codes: torch.Tensor,
    kind: int,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    threads: int = 1,
    plain: bool = False,
) -> torch.Tensor:
    m, k = x.shape
    n = scale.shape[0]
    y = torch.empty(m, n)
    off = None if offset is None else offset.data_ptr()
    rc = so.intdot_mm(
        x.data_ptr(), m, k, codes.data_ptr(), kind, scale.data_ptr(), off, n, group,
        y.data_ptr(), threads, int(plain),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"intdot_mm returned {rc}")
    return y


def reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    kind: int,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """The kernel's arithmetic in eager torch (the C file's comment), one op at a time."""
    m, k = x.shape
    n, nb = scale.shape[0], k // 32
    xb = x.view(m, nb, 32)
    amax = xb.abs().amax(-1)
    finite = torch.isfinite(xb).all(-1)
    d = torch.where(finite, amax / 127, torch.full_like(amax, float("nan")))
    live = (finite & (amax > 0))[..., None]
    q = torch.where(live, torch.round(xb / d[..., None]).clamp(-127, 127), 0).to(torch.int64)
    lpb = 4 if kind == 4 else 8  # lanes a block
    if kind == 4:
        c = torch.stack((codes & 15, codes >> 4), -1).flatten(-2).to(torch.int64)
    else:
        c = codes.to(torch.int64)
    cb, qb = c.view(n, nb, lpb, 32 // lpb), q.view(m, nb, lpb, 32 // lpb)
    p = torch.einsum("mblj,nblj->mnbl", qb, cb).float()  # exact integers
    qs = qb.sum(-1).float()  # [M, nb, lpb]
    per = group // 32
    t = (scale.repeat_interleave(per, 1)[None] * d[:, None, :])[..., None] * p
    if offset is not None:
        od = offset.repeat_interleave(per, 1)[None] * d[:, None, :]
        t = t + od[..., None] * qs[:, None]
    pad = (-nb) % (16 // lpb)
    t = torch.cat([t, torch.zeros(m, n, pad, lpb)], 2).reshape(m, n, -1, 16)
    acc = torch.zeros(m, n, 16)
    for chunk in range(t.shape[2]):
        acc = acc + t[:, :, chunk]
    h = acc[..., :8] + acc[..., 8:]
    h = h[..., :4] + h[..., 4:]
    h = h[..., :2] + h[..., 2:]
    return h[..., 0] + h[..., 1]


def weights(
    n: int, k: int, group: int, kind: int, offset: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if kind == 4:
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.01
    off = torch.randn(n, k // group, generator=gen) * 0.01 if offset else None
    return codes, scale, off


def checks(so: ctypes.CDLL) -> Record:
    gen = torch.Generator().manual_seed(42)
    equal = {"reference": 0, "plain_loops": 0, "two_threads": 0, "row_alone": 0, "half_scales": 0}
    cases = 0
    for n, k, group, kind, offset in CHECK_SHAPES:
        codes, scale, off = weights(n, k, group, kind, offset, gen)
        for m in (1, 3, 9):
            x = torch.randn(m, k, generator=gen)
            y = native(so, x, codes, kind, scale, off, group)
            cases += 1
            equal["reference"] += torch.equal(y, reference(x, codes, kind, scale, off, group))
            equal["plain_loops"] += torch.equal(
                y, native(so, x, codes, kind, scale, off, group, plain=True)
            )
            equal["two_threads"] += torch.equal(
                y, native(so, x, codes, kind, scale, off, group, threads=2)
            )
            alone = native(so, x[-1:], codes, kind, scale, off, group)
            equal["row_alone"] += torch.equal(alone[0], y[-1])
            # scales and offsets that are halves exactly, given as halves (GGUF's own form)
            sh, oh = scale.half(), None if off is None else off.half()
            wide = native(so, x, codes, kind, sh.float(), None if oh is None else oh.float(), group)
            equal["half_scales"] += torch.equal(
                wide, native(so, x, codes, kind | HALF_SCALES, sh, oh, group)
            )
    return {"cases": cases, "byte_equal": equal, "vnni": bool(so.intdot_vnni())}


def timed_us(fn: Callable[[], object], runs: int) -> float:
    """Median µs of ``runs`` calls after 3 warm-ups (``quant_bench.timed_ms``'s median)."""
    return 1e3 * timed_ms(fn, runs)[0]


def timings(so: ctypes.CDLL, model: str, threads: int, rows: int, runs: int) -> Record:
    from shard.model.quant import Quantized, QuantLinear

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(7)
    layers, shapes = MODELS[model]
    out: Record = {"model": model, "threads": threads, "rows": rows, "products": []}
    step = {"torch_us": 0.0, "intdot_us": 0.0}
    for name, n, k, kind, offset in shapes:
        codes, scale, off = weights(n, k, 32, kind, offset, gen)
        q = Quantized("int4" if kind == 4 else "int8", codes, scale, off, 32)
        linear = QuantLinear(q)
        x = torch.randn(rows, k, generator=gen)
        with torch.inference_mode():
            ours = timed_us(functools.partial(linear, x), runs)
        kernel = functools.partial(native, so, x, codes, kind, scale, off, 32, threads)
        theirs = timed_us(kernel, runs)
        times = 1 if name == "head" else layers
        step["torch_us"] += ours * times
        step["intdot_us"] += theirs * times
        out["products"].append(
            {"name": name, "shape": [n, k], "path": linear.path, "torch_us": ours,
             "intdot_us": theirs, "torch_over_intdot": ours / theirs}
        )  # fmt: skip
        print(f"{model} T={threads} M={rows} {name} {n}x{k}: {linear.path} {ours:.0f} us, "
              f"intdot {theirs:.0f} us ({ours / theirs:.2f}x)", flush=True)  # fmt: skip
    out["step"] = {**step, "torch_over_intdot": step["torch_us"] / step["intdot_us"]}
    return out


def in_model(so: ctypes.CDLL, model: str, threads: int, steps: int, reps: int) -> Record:
    """Decode steps of ``model`` with its products as loaded and swapped for the kernel."""
    from shard.convert.bundled import resolve_model
    from shard.model import quant
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage

    torch.set_num_threads(threads)
    kept: dict[int, Any] = {}
    init = quant.QuantLinear.__init__

    def keeping(self: Any, q: Any, device: Any = "cpu", bias: Any = None) -> None:
        init(self, q, device, bias)
        kept[id(self)] = q  # the codes as stored, which the kernel reads

    quant.QuantLinear.__init__ = keeping  # type: ignore[method-assign]
    try:
        model_dir = resolve_model(model, progress=False)
        n = ModelConfig.from_dir(model_dir).n_layers
        loaded = load_stage(model_dir, 0, n, weights="stored", join=False)
        swapped = load_stage(model_dir, 0, n, weights="stored", join=False)
    finally:
        quant.QuantLinear.__init__ = init  # type: ignore[method-assign]
    count = 0
    for mod in swapped.modules():
        q = kept.get(id(mod))
        if q is None or mod.path not in ("int4", "int8-group") or q.group % 32:
            continue

        def forward(x: torch.Tensor, q: Any = q, mod: Any = mod) -> torch.Tensor:
            rows = x.reshape(-1, mod.in_features).float().contiguous()
            kind = 4 if q.kind == "int4" else 8
            y = native(so, rows, q.codes, kind, q.scale, q.offset, q.group, threads)
            y = y.to(x.dtype).reshape(*x.shape[:-1], mod.out_features)
            return y if mod.bias is None else y + mod.bias

        mod.forward = forward
        count += 1

    def step_ms(stage: Any) -> float:
        with torch.inference_mode():
            cache = stage.new_cache(64 + steps)
            logits = stage(torch.arange(1, 9).unsqueeze(0), 0, cache, head_rows=1)
            times = []
            for i in range(10 + steps):
                t0 = time.perf_counter()
                logits = stage(logits[0, -1].argmax().view(1, 1), 8 + i, cache, head_rows=1)
                if i >= 10:
                    times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    runs = [(step_ms(loaded), step_ms(swapped)) for _ in range(reps)]
    out: Record = {"model": model, "threads": threads, "swapped_products": count}
    out["loaded_ms"] = statistics.median(r[0] for r in runs)
    out["intdot_ms"] = statistics.median(r[1] for r in runs)
    out["runs"] = runs
    out["loaded_over_intdot"] = out["loaded_ms"] / out["intdot_ms"]
    print(f"{model} T={threads} in the model: {out['loaded_ms']:.2f} ms a step as loaded, "
          f"{out['intdot_ms']:.2f} with the kernel", flush=True)  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    so = build()
    record: Record = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "git": git_info(),
        "load_before": os.getloadavg(),
    }
    record["checks"] = checks(so)
    tiny = weights(16, 32, 32, 4, True, torch.Generator().manual_seed(1))
    record["call_us"] = timed_us(functools.partial(native, so, torch.randn(1, 32), tiny[0], 4,
                                                   tiny[1], tiny[2], 32), args.runs)  # fmt: skip
    print(f"a call of a 16 x 32 product: {record['call_us']:.1f} us", flush=True)
    print("checks:", record["checks"], flush=True)
    record["timings"] = [
        timings(so, model, int(t), int(r), args.runs)
        for model in args.models.split(",")
        for t in args.threads.split(",")
        for r in args.rows.split(",")
    ]
    record["in_model"] = [
        in_model(so, model, int(t), args.steps, args.reps)
        for model in args.models.split(",")
        for t in args.threads.split(",")
    ]
    record["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
