"""What a linear-attention rollback costs, three ways, on one Qwen3-Next-80B DeltaNet layer.

A Gated DeltaNet layer's state cannot be cut back to a position (``shard.model.recurrent``).
Three ways to give a chunk that starts ``back`` positions behind the live state the state it
needs, measured side by side on one layer of the published Qwen3-Next-80B-A3B shape (32 value
heads of 128 x 128, 16 key heads, a 4-tap convolution; random weights, the timing does not
depend on them) in float32 on this CPU:

- ``snapshot + replay`` (what shard does): the snapshot before the chunk, then at most
  ``EVERY - 1`` kept steps replayed (``GatedDeltaNet._step``), measured at the worst case;
- ``state per position``: a copy of the kept state, no replay; its memory is a state per
  position of the rollback window;
- ``recompute``: the layer's prefill of the whole session (``context`` positions) again.

Each is timed ``--reps`` times interleaved (median, ms), beside each scheme's bytes per layer
and session (bf16 model). Writes JSON (``--json``). A benchmark, not a test: nothing here
asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from shard.model.config import ModelConfig
from shard.model.deltanet import GatedDeltaNet
from shard.model.kvcache import KVCache
from shard.model.recurrent import EVERY, ROLLBACK, RecurrentCache, recurrent_bytes


def _config() -> ModelConfig:
    d = {
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 5120, "num_hidden_layers": 4, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 262144,
        "num_experts": 0,
    }  # fmt: skip
    return ModelConfig.from_hf(d, "qwen3-next-80b-shape")


def _cache(config: ModelConfig) -> KVCache:
    kv = KVCache.empty(0, 1, 2, 8, 256, dtype=torch.float32, device="cpu")
    kv.recurrent = RecurrentCache.of(config, 1, 1, torch.float32, "cpu")
    return kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512, help="positions before the rollback")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = _config()
    la = config.linear_attn
    assert la is not None
    layer = GatedDeltaNet(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, args.context, config.hidden_size)
    cache = _cache(config)
    rope = (torch.zeros(1, 1), torch.zeros(1, 1))
    mask = torch.ones(1, 1, dtype=torch.bool)
    times: dict[str, list[float]] = {"snapshot_replay": [], "state_per_position": [],
                                     "recompute": []}  # fmt: skip
    rc = cache.recurrent
    assert rc is not None
    with torch.no_grad():
        layer(x, rope, mask, cache, 0, 0)
        worst = (args.context // EVERY) * EVERY - 1  # the start EVERY - 1 steps past a snapshot
        for _ in range(args.reps):
            t = time.perf_counter()
            state, first = rc.state_before(0, worst)
            for p in range(first, worst):
                state = layer._step(state, *rc.step_inputs(0, p))[0]
            times["snapshot_replay"].append(time.perf_counter() - t)
            t = time.perf_counter()
            state = rc.state[0].clone()  # what a state kept per position would cost to take
            times["state_per_position"].append(time.perf_counter() - t)
            t = time.perf_counter()
            layer(x, rope, mask, _cache(config), 0, 0)
            times["recompute"].append(time.perf_counter() - t)
    state_bytes = la.state_elements * 4
    kept = recurrent_bytes(
        heads=la.n_v_heads, k_dim=la.k_head_dim, v_dim=la.v_head_dim, conv_dim=la.conv_dim,
        kernel=la.conv_kernel, elem=2,
    )  # fmt: skip
    out: dict[str, Any] = {
        "shape": "Qwen3-Next-80B-A3B DeltaNet layer (32 x 128 x 128 state)",
        "context": args.context,
        "threads": args.threads,
        "loadavg": os.getloadavg(),
        "median_ms": {k: 1000 * statistics.median(v) for k, v in times.items()},
        "replayed_steps_worst": EVERY - 1,
        "bytes_per_layer_session": {
            "snapshot_replay": kept,
            "state_per_position": (ROLLBACK + 1) * state_bytes,
            "recompute": state_bytes,
        },
    }
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
