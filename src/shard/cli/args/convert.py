"""``shard convert``'s arguments (run by ``shard.cli.convert``): a tool that reports its own
usage errors in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

from shard.cli.args.base import Parser


def add_convert(sub: argparse._SubParsersAction[Parser]) -> None:
    conv = sub.add_parser(
        "convert",
        help="convert a GGUF checkpoint to a Hugging Face directory (safetensors)",
        description="Convert a Llama, Mistral, Mixtral, Gemma 3, Qwen3, Qwen3-MoE, gpt-oss or "
        "GLM-4.5-MoE GGUF checkpoint into a model "
        "directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json); "
        "quantized tensors stay quantized where an exact mapping exists (docs/model.md).",
    )
    conv.reports, conv.strict = "shard convert", True
    conv.add_argument("gguf", type=Path, metavar="MODEL.gguf", help="the GGUF file to read")
    conv.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="a new directory")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.add_argument(
        "--float32",
        action="store_true",
        help="dequantize every tensor to float32 (a checkpoint transformers can load)",
    )
