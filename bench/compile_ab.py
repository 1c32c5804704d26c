"""A stage's forward under ``torch.compile`` against eager (issue 42), side by side.

Issue 42 lists compiled graphs per chunk shape, where exact, among the candidates for a fast
CPU forward. This measures what torch's own compiler (Inductor, CPU backend: it needs a C++
compiler) gives on a whole-model stored stage of each bundled model, and whether its bytes
equal eager's. Nothing in ``src/`` uses it; the variants are built here:

- ``naive``: ``torch.compile(stage, dynamic=True)`` on the stage as it is.
- ``layer-cache``: the same, with the KV cache kept as one buffer per layer (patched here).
  The cache is one ``[layers, ...]`` tensor, and a write into one layer's slice of a compiled
  input is rewritten as a copy of the whole tensor, once per layer per step.
- ``exact``: ``layer-cache`` with every reduction and transcendental (the RMS norm's mean
  and ``rsqrt``, SiLU and GELU-tanh, the soft cap's ``tanh``) kept opaque to the compiler as
  custom ops that run eager's own code, no fused multiply-add
  (``enable_floating_point_contract_flag = "off"``), and bf16 rounding after every op
  (``emulate_precision_casts``): what the compiler may still fuse is element-wise arithmetic,
  which rounds as eager's does.

Each variant runs in a child process of its own (its patches and compiler settings are
global), which loads the stage once and, per repetition (``--reps``, order alternating),
times ``--tokens`` decode steps eager and compiled, and a 9-row verify chunk (median of
``--runs``), and compares their logits bit for bit. Each child compiles into an empty
Inductor cache of its own. Writes ``bench/results/compile_ab.json``: compile seconds (first
decode step, first verify chunk), medians, ratios, equality, and the load average.
A benchmark, not a test: run it alone.

    .venv/bin/python bench/compile_ab.py [--models smollm2,gemma3-270m] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from plain_ring import REPO, run_record, write_record

VARIANTS = ("naive", "layer-cache", "exact")
K = 8  # drafted tokens in a verify chunk


def patch_layer_cache() -> None:
    """KV writes into one buffer per layer (module docstring, ``layer-cache``)."""
    from shard.model import kvcache

    def update(self: Any, layer: int, start: int, k: Any, v: Any) -> Any:
        if not hasattr(self, "layers_k"):
            self.layers_k = [t.clone() for t in self.k.unbind(0)]
            self.layers_v = [t.clone() for t in self.v.unbind(0)]
        end = start + k.shape[2]
        self.layers_k[layer][:, :, start:end] = k
        self.layers_v[layer][:, :, start:end] = v
        return self.layers_k[layer][:, :, :end], self.layers_v[layer][:, :, :end]

    kvcache.KVCache.update = update  # type: ignore[method-assign]


def patch_exact() -> None:
    """Reductions and transcendentals opaque to Inductor (module docstring, ``exact``)."""
    import torch
    import torch._inductor.config as inductor
    import torch.nn.functional as F
    from torch import Tensor

    from shard.model import attention, llama, moe

    inductor.cpp.enable_floating_point_contract_flag = "off"
    inductor.emulate_precision_casts = True

    @torch.library.custom_op(
        "shard_bench::rms_scale", mutates_args=(), schema="(Tensor h, float eps) -> Tensor"
    )
    def rms_scale(h: Tensor, eps: float) -> Tensor:
        return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    @rms_scale.register_fake
    def _(h: Tensor, eps: float) -> Tensor:
        return h.new_empty((*h.shape[:-1], 1))

    @torch.library.custom_op(
        "shard_bench::act", mutates_args=(), schema="(Tensor x, str name) -> Tensor"
    )
    def act(x: Tensor, name: str) -> Tensor:
        return F.gelu(x, approximate="tanh") if name == "gelu_pytorch_tanh" else F.silu(x)

    @act.register_fake
    def _(x: Tensor, name: str) -> Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op("shard_bench::tanh", mutates_args=(), schema="(Tensor x) -> Tensor")
    def tanh(x: Tensor) -> Tensor:
        return torch.tanh(x)

    @tanh.register_fake
    def _(x: Tensor) -> Tensor:
        return torch.empty_like(x)

    def scale(h: Tensor, eps: float) -> Tensor:
        if torch.compiler.is_compiling():
            return rms_scale(h, eps)
        return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    def rms(self: Any, x: Tensor) -> Tensor:
        h = x.float()
        return self.weight * (h * scale(h, self.eps)).to(x.dtype)

    def gemma_rms(self: Any, x: Tensor) -> Tensor:
        h = x.float()
        return ((h * scale(h, self.eps)) * (1.0 + self.weight.float())).type_as(x)

    eager_act = moe._act

    def any_act(name: str, x: Tensor) -> Tensor:
        return act(x, name) if torch.compiler.is_compiling() else eager_act(name, x)

    def logits(self: Any, normed: Tensor) -> Tensor:
        out = self.lm_head(normed)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            t = tanh(out / cap) if torch.compiler.is_compiling() else torch.tanh(out / cap)
            out = t * cap
        return out.float()

    attention.RMSNorm.forward = rms  # type: ignore[method-assign]
    attention.GemmaRMSNorm.forward = gemma_rms  # type: ignore[method-assign]
    moe._act = any_act
    llama.StageModel.logits = logits  # type: ignore[method-assign]


def child(model: str, variant: str, threads: int, reps: int, tokens: int, runs: int) -> dict:
    """One variant in this process (module docstring); returns its record."""
    import torch

    if variant in ("layer-cache", "exact"):
        patch_layer_cache()
    if variant == "exact":
        patch_exact()
    from quant_bench import timed_ms
    from shard.convert.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage

    torch.set_num_threads(threads)
    model_dir = resolve_model(model, progress=False)
    stage = load_stage(model_dir, 0, ModelConfig.from_dir(model_dir).n_layers, weights="stored")
    compiled = torch.compile(stage, dynamic=True)
    nine = torch.arange(1, K + 2).unsqueeze(0)

    def decode(fn: Any) -> tuple[float, list[Any]]:
        cache = stage.new_cache(256)
        logits = fn(torch.arange(1, 9).unsqueeze(0), 0, cache, head_rows=1)
        outs, t0 = [logits], time.perf_counter()
        for pos in range(8, 8 + tokens):
            logits = fn(logits[0, -1].argmax().view(1, 1), pos, cache, head_rows=1)
            outs.append(logits)
        ms = (time.perf_counter() - t0) * 1e3 / tokens
        outs.append(fn(nine, 8 + tokens, cache, head_rows=K + 1))
        return ms, outs

    record: dict[str, Any] = {"model": model, "variant": variant, "threads": threads}
    with torch.inference_mode():
        cache = stage.new_cache(256)
        t0 = time.perf_counter()
        compiled(torch.arange(1, 9).unsqueeze(0), 0, cache, head_rows=1)
        compiled(torch.tensor([[5]]), 8, cache, head_rows=1)
        record["compile_decode_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled(nine, 9, cache, head_rows=K + 1)
        record["compile_verify_s"] = time.perf_counter() - t0
        rows: dict[str, list[dict[str, float]]] = {"eager": [], "compiled": []}
        equal = True
        for rep in range(reps):
            outs = {}
            for name in ("eager", "compiled") if rep % 2 == 0 else ("compiled", "eager"):
                fn = stage if name == "eager" else compiled
                ms, outs[name] = decode(fn)
                cache = stage.new_cache(256)
                verify = timed_ms(lambda fn=fn, c=cache: fn(nine, 100, c, head_rows=K + 1), runs)
                rows[name].append({"decode_ms": ms, "verify9_ms": verify[0]})
            equal = equal and all(
                torch.equal(a, b) for a, b in zip(outs["eager"], outs["compiled"], strict=True)
            )
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in rows.items()}
    record.update(
        reps=rows,
        median=med,
        eager_over_compiled_decode=med["eager"]["decode_ms"] / med["compiled"]["decode_ms"],
        eager_over_compiled_verify9=med["eager"]["verify9_ms"] / med["compiled"]["verify9_ms"],
        logits_equal=equal,
    )
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--threads", default="1")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=5, help="timed verify chunks per repetition")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "compile_ab.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        model, variant, threads = args.child.split(":")
        rec = child(model, variant, int(threads), args.reps, args.tokens, args.runs)
        print(json.dumps(rec))
        return 0
    result = run_record("compile_ab", runs=[])
    for model in args.models.split(","):
        for threads in args.threads.split(","):
            for variant in args.variants.split(","):
                cmd = [sys.executable, __file__, "--child", f"{model}:{variant}:{threads}"]
                cmd += ["--reps", str(args.reps), "--tokens", str(args.tokens)]
                cmd += ["--runs", str(args.runs)]
                cold = tempfile.mkdtemp(prefix="shard-inductor-")  # compile from nothing
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cold}
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                finally:
                    shutil.rmtree(cold, ignore_errors=True)
                if done.returncode != 0:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                rec = json.loads(done.stdout.strip().splitlines()[-1])
                rec["load_after"] = os.getloadavg()
                result["runs"].append(rec)
                med = rec["median"]
                print(
                    f"{model} t={threads} {variant}: compile {rec['compile_decode_s']:.0f}"
                    f"+{rec['compile_verify_s']:.0f} s; decode {med['eager']['decode_ms']:.1f}"
                    f" -> {med['compiled']['decode_ms']:.1f} ms "
                    f"({rec['eager_over_compiled_decode']:.2f}x), verify9 "
                    f"{med['eager']['verify9_ms']:.1f} -> {med['compiled']['verify9_ms']:.1f}"
                    f" ({rec['eager_over_compiled_verify9']:.2f}x); "
                    f"logits {'equal' if rec['logits_equal'] else 'DIFFER'}",
                    flush=True,
                )
    write_record(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
