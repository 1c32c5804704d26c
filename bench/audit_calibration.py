"""How far an honest batched stage's output is from an auditor's lone recomputation, in the
spot checks' sketch (``shard.audit.compare.sketch``), and how far each lie is — the measurement
behind ``shard.audit.compare.HONEST_GAP`` (the calibrated ``cosine_threshold``).

For each model (the tiny test checkpoints at a few seeds, and the bundled SmolLM2) and each
of its middle blocks, ``--sessions`` sessions run side by side as a batched stage runs them
(``shard.model.packed.forward_packed``: a prompt chunk each, then decode steps, every step of
every session in one forward, the KV written by batched forwards) and as the auditor replays
each one alone (``StageModel.__call__``, a fresh cache per session, the same inputs). Per
chunk: 1 − the smallest per-row cosine of the two outputs' sketches (256 dims, a fresh seed
per chunk). Then the lies the audits must catch, on the same chunks against the lone
reference: Gaussian noise at 1e-3, 1e-2 and 3e-2 of the output's std, the block without its
last layer, and the input passed on. ``--dtype bfloat16`` runs the stage in bf16 against a
bf16 lone auditor (batching bit for bit on the CPU: see docs/ring.md); ``--cross`` compares
a bf16 stage with a float32 auditor (mixed precision). Quantized rows (``--weights``:
``int4`` on the tiny checkpoints, ``stored`` and ``int4`` on SmolLM2) hold the audited block
quantized at both ends (the auditor replays on the stage's kernels), float32 activations;
every row counts the chunks whose batched output equals the lone replay bit for bit.

Writes JSON (``--json``). A benchmark, not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from shard.audit.compare import sketch  # noqa: E402
from shard.convert.bundled import resolve_model  # noqa: E402
from shard.model.llama import StageModel  # noqa: E402
from shard.model.loader import load_stage  # noqa: E402
from shard.model.masks import causal_mask  # noqa: E402
from shard.model.packed import Segment, forward_packed  # noqa: E402
from shard.testing import make_tiny_checkpoint  # noqa: E402

LIES = ("noise1e-3", "noise1e-2", "noise3e-2", "skip_layer", "identity")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sessions", type=int, default=6, help="sessions batched together")
    p.add_argument("--steps", type=int, default=12, help="decode steps after the prompt chunk")
    p.add_argument("--prompt", type=int, default=9, help="rows of each prompt chunk")
    p.add_argument("--tiny-seeds", default="11,3,7", help="tiny checkpoints (6 layers) to measure")
    p.add_argument("--smollm2", default="smollm2", help="bundled model ('' to skip)")
    p.add_argument("--weights", default="int4,stored", help="quantized rows ('' to skip)")
    p.add_argument("--json", type=Path, default=REPO / "bench/results/audit_calibration.json")
    return p.parse_args(argv)


def _gap(a: torch.Tensor, b: torch.Tensor, seed: bytes) -> float:
    """1 − the smallest per-row cosine of the two outputs' sketches."""
    sa, sb = sketch(a, seed), sketch(b, seed)
    cos = (sa * sb).sum(1) / (sa.norm(dim=1) * sb.norm(dim=1))
    return float(1.0 - cos.min())


def _without_last(block: StageModel, x: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
    m = block
    s = int(x.shape[1])
    rope = (m.rope_cos[start : start + s].to(x.dtype), m.rope_sin[start : start + s].to(x.dtype))
    mask = causal_mask(start, s, x.device, m.blocks()[0].window)
    h = x
    for j, layer in enumerate(list(m.layers)[:-1]):
        h = layer(h, rope, mask, cache, j, start)
    return h


def measure(
    stage: StageModel,
    auditor: StageModel,
    head: StageModel,
    args: argparse.Namespace,
    rng: random.Random,
) -> dict[str, Any]:
    """Honest and lying gaps for ``stage`` (batched) against ``auditor`` (lone)."""
    vocab, n = head.config.vocab_size, args.sessions
    max_len = args.prompt + args.steps + 1
    heads = [head.new_cache(max_len) for _ in range(n)]
    staged = [stage.new_cache(max_len) for _ in range(n)]
    lone = [auditor.new_cache(max_len) for _ in range(n)]
    scratch = [auditor.new_cache(max_len) for _ in range(n)]  # the liars' own (lone) KV
    honest: list[float] = []
    same = 0  # chunks whose batched output is the lone replay bit for bit
    lies: dict[str, list[float]] = {k: [] for k in LIES}
    start = 0
    with torch.inference_mode():
        for step in range(args.steps + 1):
            rows = args.prompt if step == 0 else 1
            xs = [
                head(torch.tensor([[rng.randrange(vocab) for _ in range(rows)]]), start, heads[i])
                for i in range(n)
            ]  # [1, S, D] each
            packed = torch.cat([x.to(stage.dtype) for x in xs], dim=1)
            out = forward_packed(stage, packed, [Segment(start, rows, c) for c in staged])
            for i, x in enumerate(xs):
                claimed = out[:, i * rows : (i + 1) * rows]
                ref = auditor(x.to(auditor.dtype), start, lone[i])
                seed = rng.randbytes(32)
                honest.append(_gap(claimed, ref, seed))
                same += torch.equal(claimed, ref)
                std = float(claimed.float().std())
                for scale in ("1e-3", "1e-2", "3e-2"):
                    noisy = claimed.float() + torch.randn(claimed.shape) * std * float(scale)
                    lies[f"noise{scale}"].append(_gap(noisy, ref, seed))
                skipped = _without_last(auditor, x.to(auditor.dtype), start, scratch[i])
                lies["skip_layer"].append(_gap(skipped, ref, seed))
                lies["identity"].append(_gap(x, ref, seed))
            start += rows
    return {
        "chunks": len(honest),
        "bit_equal": same,
        "honest_max": max(honest),
        "honest_median": sorted(honest)[len(honest) // 2],
        "lies_min": {k: min(v) for k, v in lies.items()},
    }


def blocks_of(n_layers: int) -> list[tuple[int, int]]:
    """The middle blocks a 3-stage ring would hold (the stage after the first two)."""
    third = n_layers // 3
    return [(third, 2 * third)]


def run_model(
    name: str,
    model_dir: Path,
    dtype: torch.dtype,
    auditor_dtype: torch.dtype,
    args: argparse.Namespace,
    weights: str | None = None,
) -> list[dict[str, Any]]:
    from shard.model.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    out = []
    for first, last in blocks_of(config.n_layers):
        head = load_stage(model_dir, 0, first, dtype=torch.float32, weights="float32")
        # Dense rows name their floats: no choice would resolve a stored checkpoint to "stored".
        dense, dense_auditor = (str(t).removeprefix("torch.") for t in (dtype, auditor_dtype))
        stage = load_stage(model_dir, first, last, dtype=dtype, weights=weights or dense)
        auditor = load_stage(
            model_dir, first, last, dtype=auditor_dtype, weights=weights or dense_auditor
        )
        began = time.perf_counter()
        row = measure(stage, auditor, head, args, random.Random(f"{name}{first}"))
        row |= {
            "model": name,
            "block": [first, last],
            "stage_dtype": str(dtype).removeprefix("torch."),
            "auditor_dtype": str(auditor_dtype).removeprefix("torch."),
            "weights": weights or "dense",
            "seconds": round(time.perf_counter() - began, 1),
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    quantized = [w for w in args.weights.split(",") if w]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for seed in [int(s) for s in args.tiny_seeds.split(",") if s]:
            d = make_tiny_checkpoint(Path(tmp) / f"tiny{seed}", seed=seed, n_layers=6)
            for dt, adt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                            (torch.bfloat16, torch.float32)):  # fmt: skip
                rows += run_model(f"tiny-{seed}", d, dt, adt, args)
            if "int4" in quantized:
                rows += run_model(f"tiny-{seed}", d, torch.float32, torch.float32, args, "int4")
    if args.smollm2:
        d = resolve_model(args.smollm2)
        for dt, adt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                        (torch.bfloat16, torch.float32)):  # fmt: skip
            rows += run_model("smollm2", d, dt, adt, args)
        for weights in quantized:
            rows += run_model("smollm2", d, torch.float32, torch.float32, args, weights)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(sys.argv), "sessions": args.sessions, "steps": args.steps,
              "prompt": args.prompt, "rows": rows}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
