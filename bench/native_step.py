"""A whole decode step in C against shard's forward and llama.cpp's (issue 42): the ceiling.

An experiment, not shard's forward. ``bench/intdot/layer.c`` runs a Llama-family layer's
decode step for one row in one C call (norm, q/k/v, rotary, cache, attention, output,
residual, norm, gate/up, SiLU, down, residual), its products ``intdot.c``'s integer-dot
kernel on the codes as stored, and the final norm and head in one more. What it measures is
what a stage's step costs when the framework's share is gone: whether a native layer forward
would reach issue 42's 0.9x llama.cpp, and what is left to the products.

On SmolLM2-135M (the bundled Q4_1 GGUF, held as stored; the only bundled model whose layers
this C covers: Gemma 3's norms, activation and head differ), for each thread count
(``--threads``), ``--reps`` times interleaved:

- **shard**: the stage as loaded (``load_stage(..., weights="stored")``, siblings joined),
  ``--tokens`` greedy one-row steps after an 8-token prompt and 4 untimed steps;
- **native**: the same steps through the C step, from the same stored codes and norms;
- **llama.cpp**: ``llama-bench -n TOKENS -p 0`` on the same GGUF and threads
  (``bench/llama_cpp.py`` builds it into the cache folder).

The C step is not bit-defined against shard's forward (float32 activations quantized to int8
per block, as llama.cpp quantizes them for Q4_1, and its own sums): fed shard's greedy tokens
(teacher-forced), the script counts the steps where the C step's greedy choice is shard's,
which says the C computes the same model, not the same bytes. Its logits differ from the
float32 model's by 2-5x what shard's stored path's do; a torch emulation of the same step
with the same integer-dot products gives the same error, so it is the activations'
quantization, not the C. Writes
``bench/results/native_step.json``. A benchmark, not a test: nothing here asserts. Run it
alone: every figure shares this CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from intdot import compiled
from plain_ring import REPO, git_info, machine_info

Record = dict[str, Any]
SOURCE = REPO / "bench" / "intdot" / "layer.c"
MODEL = "smollm2"
HALF_SCALES = 0x100  # intdot.c: scales and offsets given as halves


class Product(ctypes.Structure):
    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("kind", ctypes.c_int),
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--tokens", type=int, default=64, help="timed decode steps")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "native_step.json")
    return p.parse_args(argv)


def build() -> ctypes.CDLL:
    return ctypes.CDLL(str(compiled(SOURCE)))


class Native:
    """The C step over a loaded stage's stored codes (kept by ``load``)."""

    def __init__(
        self, so: ctypes.CDLL, stage: Any, kept: dict[int, Any], max_len: int, half: bool
    ) -> None:
        from shard.model.attention import rope_tables

        cfg = stage.config
        self.half = half  # scales and offsets held as halves (exact for Q4_1 and Q8_0)
        self.half_exact = True
        self.so, self.stage, self.cfg, self.max_len = so, stage, cfg, max_len
        self.keep: list[torch.Tensor] = []  # everything the C reads, alive
        layers = []
        norms = []
        for block in stage.blocks():
            attn, mlp = block.self_attn, block.mlp
            qkv = [kept[id(attn.q_proj)], kept[id(attn.k_proj)], kept[id(attn.v_proj)]]
            gate_up = [kept[id(mlp.gate_proj)], kept[id(mlp.up_proj)]]
            layers += [
                self._product(qkv),
                self._product([kept[id(attn.o_proj)]]),
                self._product(gate_up),
                self._product([kept[id(mlp.down_proj)]]),
            ]
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                w = norm.weight.detach().float().contiguous()
                self.keep.append(w)
                norms.append(w.data_ptr())
        self.layers = (Product * len(layers))(*layers)
        self.norms = (ctypes.c_void_p * len(norms))(*norms)
        self.final = stage.norm.weight.detach().float().contiguous()
        self.head = self._product([kept[id(stage.lm_head)]])
        cos, sin = rope_tables(cfg, length=max_len)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        kv, dh = cfg.n_kv_heads, cfg.head_dim
        self.kc = torch.zeros(cfg.n_layers, kv, max_len, dh)
        self.vc = torch.zeros_like(self.kc)
        width = cfg.hidden_size + (cfg.n_heads + 2 * kv) * dh + 2 * cfg.intermediate_size
        self.scratch = torch.zeros(4 * (width + cfg.intermediate_size + max_len))
        self.logits = torch.zeros(cfg.vocab_size)
        p = ctypes.c_void_p
        i64, f32 = ctypes.c_int64, ctypes.c_float
        head: list[Any] = [p, i64, i64, p, p, p, ctypes.POINTER(Product), f32]
        shape: list[Any] = [i64] * 5  # hidden, heads, kv heads, head dim, feed-forward width
        rest: list[Any] = [p, p, i64, p, p, p, p, ctypes.c_int]
        so.native_step.argtypes = head + shape + rest

    def _product(self, parts: list[Any]) -> Product:
        codes = torch.cat([q.codes for q in parts]).contiguous()
        scale = torch.cat([q.scale for q in parts]).contiguous()
        offsets = [q.offset for q in parts]
        offset = None if offsets[0] is None else torch.cat(offsets).contiguous()
        n, k = int(scale.shape[0]), int(scale.shape[1]) * parts[0].group
        kind = 4 if parts[0].kind == "int4" else 8
        if self.half:
            for t in (scale, offset):
                if t is not None:
                    self.half_exact &= bool(torch.equal(t.half().float(), t))
            scale = scale.half()
            offset = None if offset is None else offset.half()
            kind |= HALF_SCALES
        self.keep += [t for t in (codes, scale, offset) if t is not None]
        off = None if offset is None else offset.data_ptr()
        return Product(codes.data_ptr(), scale.data_ptr(), off, n, k, parts[0].group, kind)

    def step(self, token: int, pos: int, threads: int) -> int:
        cfg = self.cfg
        x = self.stage.embed(torch.tensor([[token]]))[0, 0].float().contiguous()
        self.so.native_step(
            x.data_ptr(), pos, cfg.n_layers, self.layers, self.norms, self.final.data_ptr(),
            ctypes.byref(self.head), cfg.rms_norm_eps, cfg.hidden_size, cfg.n_heads,
            cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size, self.kc.data_ptr(),
            self.vc.data_ptr(), self.max_len, self.cos[pos].data_ptr(), self.sin[pos].data_ptr(),
            self.scratch.data_ptr(), self.logits.data_ptr(), threads,
        )  # fmt: skip
        return int(self.logits.argmax())


def load() -> tuple[Any, Any, dict[int, Any]]:
    """SmolLM2 loaded as stored twice (joined, as shard runs it; unjoined, its codes kept)."""
    from shard.convert.bundled import resolve_model
    from shard.model import quant
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage

    model_dir = resolve_model(MODEL, progress=False)
    n = ModelConfig.from_dir(model_dir).n_layers
    shard_stage = load_stage(model_dir, 0, n, weights="stored")
    kept: dict[int, Any] = {}
    init = quant.QuantLinear.__init__

    def keeping(self: Any, q: Any, device: Any = "cpu", bias: Any = None) -> None:
        init(self, q, device, bias)
        kept[id(self)] = q

    quant.QuantLinear.__init__ = keeping  # type: ignore[method-assign]
    try:
        codes_stage = load_stage(model_dir, 0, n, weights="stored", join=False)
    finally:
        quant.QuantLinear.__init__ = init  # type: ignore[method-assign]
    return shard_stage, codes_stage, kept


#: 8 fixed ids; SmolLM2's tokenizer decodes them as "<|im_start|>Therong of France is a real"
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]


def shard_run(stage: Any, threads: int, tokens: int) -> tuple[float, list[int]]:
    torch.set_num_threads(threads)
    out: list[int] = []
    times = []
    with torch.inference_mode():
        cache = stage.new_cache(64 + tokens)
        logits = stage(torch.tensor([PROMPT]), 0, cache, head_rows=1)
        for i in range(4 + tokens):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            t0 = time.perf_counter()
            logits = stage(torch.tensor([[nxt]]), len(PROMPT) + i, cache, head_rows=1)
            if i >= 4:
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def native_run(native: Native, threads: int, forced: Sequence[int]) -> tuple[float, list[int]]:
    """Median ms a step, and the C step's greedy choice at each step, fed ``forced`` (shard's
    own greedy tokens: teacher-forced, so one near-tie does not change every later context)."""
    torch.set_num_threads(threads)
    native.kc.zero_()
    native.vc.zero_()
    nxt = 0
    for pos, token in enumerate(PROMPT):
        nxt = native.step(token, pos, threads)
    out: list[int] = []
    times = []
    for i, token in enumerate(forced):
        out.append(nxt)
        t0 = time.perf_counter()
        nxt = native.step(token, len(PROMPT) + i, threads)
        if i >= 4:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def llama_tg(binary: Path, gguf: Path, threads: int, tokens: int) -> float | None:
    """llama.cpp's decode tok/s (``llama-bench -n TOKENS -p 0 -r 1``), None if it failed."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-n", str(tokens), "-p", "0",
           "-r", "1", "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else []
    return float(rows[0]["avg_ts"]) if rows else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    so = build()
    shard_stage, codes_stage, kept = load()
    length = 64 + args.tokens + len(PROMPT)
    natives = {"native": Native(so, codes_stage, kept, length, half=False)}
    natives["native_half"] = Native(so, codes_stage, kept, length, half=True)
    llama = gguf = None
    if not args.no_llama:
        from llama_cpp import build as llama_build
        from shard.convert.bundled import _bundled_gguf

        llama, gguf = llama_build(), _bundled_gguf(MODEL)
    record: Record = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "git": git_info(),
        "load_before": os.getloadavg(),
        "model": MODEL,
        "tokens": args.tokens,
        "records": [],
        "half_exact": natives["native_half"].half_exact,
    }
    for rep in range(args.reps):
        for t in (int(x) for x in args.threads.split(",")):
            row: Record = {"rep": rep, "threads": t}
            row["shard_ms"], ours = shard_run(shard_stage, t, args.tokens)
            row["greedy_of"] = len(ours)
            for name, native in natives.items():
                row[f"{name}_ms"], theirs = native_run(native, t, ours)
                row[f"{name}_agree"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
            if llama is not None and gguf is not None:
                row["llama_tok_s"] = llama_tg(llama, gguf, t, args.tokens)
            record["records"].append(row)
            print(row, flush=True)
    summary = []
    for t in (int(x) for x in args.threads.split(",")):
        rows = [r for r in record["records"] if r["threads"] == t]
        s: Record = {"threads": t}
        s["shard_tok_s"] = 1e3 / statistics.median(r["shard_ms"] for r in rows)
        for name in natives:
            s[f"{name}_tok_s"] = 1e3 / statistics.median(r[f"{name}_ms"] for r in rows)
        if all(r.get("llama_tok_s") for r in rows):
            s["llama_tok_s"] = statistics.median(r["llama_tok_s"] for r in rows)
            s["shard_over_llama"] = s["shard_tok_s"] / s["llama_tok_s"]
            for name in natives:
                s[f"{name}_over_llama"] = s[f"{name}_tok_s"] / s["llama_tok_s"]
        summary.append(s)
        print(s, flush=True)
    record["summary"] = summary
    record["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
