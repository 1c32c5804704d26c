"""CUDA graphs on one GPU: per-chunk stage time eager vs graphed, and a whole local ring.

Two measurements, side by side in one run, written as JSON (``--out``) and printed as a
Markdown table:

1. **Per chunk.** For each chunk shape the ring sends (decode: 1 row; verify: K+1 rows) one
   stage block (``--layers`` of the model, default all) runs the same chunk at the same
   position ``--reps`` times eagerly (``StageModel.forward_at``) and as a CUDA-graph replay
   (``shard.stage.graphs``), each timed with CUDA events after a warm-up; the medians and
   their ratio are reported, and ``identical`` says whether graphed logits equalled eager's
   bit for bit.
2. **Whole ring.** The in-process swarm (``shard.nodes.inprocess``) with every stage on
   ``cuda:0``, greedy, graphs off then ``--graphs`` mode: tokens/s of each and whether their
   output equals the single-process reference on the same GPU (the ``--local`` run).

A benchmark, not a test: it asserts nothing and refuses cleanly (one line, exit 2) on a machine
without CUDA. ``ops/gpu-check`` runs it on a GPU machine.

    .venv/bin/python bench/gpu_graphs.py --model smollm2 --out bench/results/gpu_graphs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shard.convert.bundled import resolve_model
from shard.model.config import ModelConfig
from shard.model.device import torch_dtype
from shard.model.llama import StageModel
from shard.model.loader import load_stage
from shard.stage.graphs import ChunkGraphs

PROMPT_LEN = 64


def chunk_times(model: StageModel, rows: int, reps: int) -> dict[str, Any]:
    """Median ms per chunk of ``rows`` rows, eager ``forward_at`` vs graph replay."""
    device = model.device
    max_len = PROMPT_LEN + rows + 8
    gen = torch.Generator().manual_seed(rows)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT_LEN), generator=gen).to(device)
    chunk = torch.randint(0, vocab, (1, rows), generator=gen).to(device)
    pos = torch.arange(PROMPT_LEN, PROMPT_LEN + rows, device=device)
    eager_cache, graph_cache = model.new_cache(max_len), model.new_cache(max_len)
    graphs = ChunkGraphs(model, mode="lazy", rows={rows})
    with torch.inference_mode():
        model(prompt, 0, eager_cache)
        model(prompt, 0, graph_cache)
        want = model.forward_at(chunk, pos, eager_cache)
        got = graphs(chunk, PROMPT_LEN, graph_cache)  # captures
        identical = bool(torch.equal(want, got))
        eager = _timed(lambda: model.forward_at(chunk, pos, eager_cache), reps)
        graphed = _timed(lambda: graphs(chunk, PROMPT_LEN, graph_cache), reps)
    return {
        "rows": rows,
        "eager_ms": eager,
        "graphed_ms": graphed,
        "speedup": eager / graphed if graphed > 0 else None,
        "identical": identical,
    }


def _timed(fn: Any, reps: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def ring_runs(model_dir: Path, dtype: str, graphs: str, max_tokens: int) -> dict[str, Any]:
    """Greedy through a local ring on cuda:0, graphs off and on, vs the reference there."""
    import trio

    from shard.decode.reference import generate_reference
    from shard.nodes.inprocess import run_swarm
    from shard.spec.swarm import SwarmSpec

    config = ModelConfig.from_dir(model_dir)
    prompt = list(range(10, 10 + 24))
    cut = config.n_layers // 2
    data: dict[str, Any] = {
        "swarm": {"name": "gpu", "model": str(model_dir), "insecure": True, "dtype": dtype},
        "limits": {"max_len": 512, "prefill_chunk": 128},
        "coordinator": {"name": "coord", "listen": "127.0.0.1:9000"},
        "stage": [
            {"name": f"s{i}", "listen": f"127.0.0.1:{9001 + i}", "layers": block, "device": "cuda"}
            for i, block in enumerate([[0, cut], [cut, config.n_layers]])
        ],
    }
    full = load_stage(model_dir, 0, config.n_layers, dtype=torch_dtype(dtype), device="cuda:0")
    with torch.inference_mode():
        local = generate_reference(
            full,
            prompt,
            eos_ids=config.eos_token_ids,
            max_tokens=max_tokens,
            max_len=512,
            prefill_chunk=128,
        ).token_ids
    del full
    out: dict[str, Any] = {"reference_tokens": len(local)}
    for mode in ("off", graphs):
        for stage in data["stage"]:
            stage["graphs"] = mode
        spec = SwarmSpec.from_dict(data, source="gpu_graphs")

        async def run(spec: SwarmSpec = spec) -> tuple[tuple[int, ...], float]:
            async with trio.open_nursery() as nursery:
                handle = await nursery.start(
                    lambda task_status: run_swarm(
                        spec, model_dir=model_dir, task_status=task_status
                    )
                )
                await handle.coordinator.generate(prompt, max_tokens=4)  # warm: captures
                t0 = time.perf_counter()
                done = await handle.coordinator.generate(prompt, max_tokens=max_tokens)
                elapsed = time.perf_counter() - t0
                nursery.cancel_scope.cancel()
            return done.token_ids, elapsed

        tokens, elapsed = trio.run(run)
        out[mode] = {
            "tok_s": len(tokens) / elapsed if elapsed > 0 else None,
            "equals_local": tokens == local,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="bundled name or checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=None, help="layers in the timed block")
    p.add_argument("--ks", default="0,2,4,8", help="K values: rows K+1 (0: decode, 1 row)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--graphs", default="lazy", choices=["lazy", "warm"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-ring", action="store_true", help="skip the whole-ring run")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        built = "built without CUDA" if not torch.backends.cuda.is_built() else "no GPU visible"
        print(
            f"gpu_graphs: error: needs a CUDA GPU (torch {torch.__version__}, {built})",
            file=sys.stderr,
        )
        return 2
    model_dir = resolve_model(args.model) if not Path(args.model).is_dir() else Path(args.model)
    config = ModelConfig.from_dir(model_dir)
    layers = args.layers or config.n_layers
    model = load_stage(model_dir, 0, layers, dtype=torch_dtype(args.dtype), device="cuda:0")
    rows = sorted({int(k) + 1 for k in args.ks.split(",")})
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "model": str(args.model),
        "dtype": args.dtype,
        "layers": layers,
        "chunks": [chunk_times(model, r, args.reps) for r in rows],
    }
    del model
    if not args.no_ring:
        result["ring"] = ring_runs(model_dir, args.dtype, args.graphs, args.max_tokens)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(f"device: {result['device']}  dtype {args.dtype}  layers {layers}")
    print("| rows | eager ms | graphed ms | speedup | bit-identical |")
    print("|---:|---:|---:|---:|:---:|")
    for c in result["chunks"]:
        print(
            f"| {c['rows']} | {c['eager_ms']:.3f} | {c['graphed_ms']:.3f} | "
            f"{c['speedup']:.2f}x | {c['identical']} |"
        )
    if "ring" in result:
        print(json.dumps(result["ring"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
