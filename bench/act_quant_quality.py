"""What int8 activations would cost in quality (issue 42's open decision), on both bundled models.

Issue 42's 0.9x llama.cpp needs integer-dot products (docs/benchmarks.md, "Fast stages,
session 29"): each activation row quantized per block of 32 to int8, as llama.cpp quantizes
it before every product on stored weights. That changes which tokens a stored stage
produces, so it is a quality decision. This measures it before anything is built.

Teacher-forced over the same text as ``bench/quant_quality.py`` (``bench/data/gpl-3.txt``,
~3,000 tokens, or the first ``--tokens``), in chunks of 256 positions through one KV cache,
three ways:

- ``float32``: the GGUF dequantized to float32, the reference;
- ``stored``: the weights as stored, run as shard runs them (bf16 activations into the
  kernels);
- ``int8-act``: the stored model with every product's input first rounded as llama.cpp's
  ``Q8_0`` does: per block of 32 values, ``d = max|x| / 127``, ``x = round(x / d) * d``. This is
  an emulation in torch (``QuantLinear.forward`` patched, siblings unjoined): the product
  that follows is shard's, so only the quantization error is llama.cpp's, not its float
  sums. llama.cpp uses blocks of 256 (``Q8_K``) before its K-quant products; blocks of 32 are
  used everywhere here.

Reported against ``float32``, per model: top-1 agreement of the greedy next token, the
perplexity of each on the text, and the mean KL divergence ``KL(float32 || variant)``. Writes
``bench/results/act_quant_quality.json``. A benchmark, not a test: run it alone.

    .venv/bin/python bench/act_quant_quality.py [--models smollm2,gemma3-270m] [--tokens N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from plain_ring import run_record, write_record
from quant_quality import CHUNK, TEXT

ROOT = Path(__file__).resolve().parent
BLOCK = 32


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded per block of ``BLOCK`` along its last dimension as Q8_0 stores it."""
    shape = x.shape
    blocks = x.float().reshape(-1, shape[-1] // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
    return (q * d).reshape(shape).to(x.dtype)


@contextlib.contextmanager
def int8_activations() -> Iterator[None]:
    """Every ``QuantLinear`` rounds its input first (module docstring, ``int8-act``)."""
    from shard.model.quant import QuantLinear

    product = QuantLinear.forward

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % BLOCK:
            raise SystemExit(f"an input of {x.shape[-1]} features is not in blocks of {BLOCK}")
        return product(self, int8_rows(x))

    QuantLinear.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        QuantLinear.forward = product  # type: ignore[method-assign]


def chunks_over(model: Any, ids: list[int]) -> Iterator[torch.Tensor]:
    """Next-token log-probabilities, float32, teacher-forced over ``ids`` a chunk at a time."""
    cache = model.new_cache(len(ids))
    for start in range(0, len(ids) - 1, CHUNK):
        x = torch.tensor([ids[start : min(start + CHUNK, len(ids) - 1)]])
        yield torch.log_softmax(model(x, start, cache)[0].float(), -1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--tokens", type=int, default=0, help="the first N tokens (0: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=ROOT / "results" / "act_quant_quality.json")
    args = p.parse_args(argv)
    from shard.convert.bundled import resolve_model
    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage
    from shard.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    result = run_record(
        "act_quant_quality", text=str(TEXT.relative_to(ROOT.parent)), block=BLOCK, models={}
    )
    for name in args.models.split(","):
        model_dir = resolve_model(name, progress=False)
        n = ModelConfig.from_dir(model_dir).n_layers
        ids = Tokenizer.from_dir(model_dir).encode(TEXT.read_text(encoding="utf-8"))
        ids = ids[: args.tokens or None]
        truth = torch.tensor(ids[1:])
        ref: list[torch.Tensor] = []  # float32's chunks, kept to compare the others with
        entry: dict[str, Any] = {"positions": len(ids) - 1}
        for variant in ("float32", "stored", "int8-act"):
            weights = "float32" if variant == "float32" else "stored"
            model = load_stage(model_dir, 0, n, weights=weights, join=False)
            nll = kl = agree = 0.0
            t0 = time.perf_counter()
            with (
                torch.inference_mode(),
                int8_activations() if variant == "int8-act" else contextlib.nullcontext(),
            ):
                for i, lp in enumerate(chunks_over(model, ids)):
                    if variant == "float32":
                        ref.append(lp)
                    want, rows = ref[i], truth[i * CHUNK : i * CHUNK + lp.shape[0]]
                    nll -= float(lp.gather(1, rows[:, None]).sum())
                    kl += float((want.exp() * (want - lp)).sum())
                    agree += float((lp.argmax(-1) == want.argmax(-1)).sum())
            del model
            positions = len(ids) - 1
            entry[variant] = {
                "perplexity": math.exp(nll / positions),
                "top1_agreement": agree / positions,
                "kl_from_float32": kl / positions,
                "forward_s": round(time.perf_counter() - t0, 1),
            }
        result["models"][name] = entry
        print(name, json.dumps(entry), flush=True)
    write_record(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
