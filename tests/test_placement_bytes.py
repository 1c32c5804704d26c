"""``layers = "auto"`` cuts a model by each block's real bytes: among contiguous splits, the
one whose largest stage (embedding on the first, head on the last) holds the fewest bytes,
checked against a brute force over every split, on Gemma 3 270M's real config (its
embedding is most of its bytes) and on a tiny GLM-4.5-MoE whose first layers are dense;
through a spec, ``shard plan SPEC``, ``swarm up``'s plan, ``shard plan --config`` and a
ring whose speeds are measured (formation)."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from family_fixtures import BASE, FAMILIES, family_checkpoint
from shard.cli import main
from shard.cli.swarm import planned
from shard.model.config import ModelConfig
from shard.model.footprint import Footprint, measured, predict
from shard.model.loader import load_stage
from shard.model.quant import kernel_dtype
from shard.nodes.sizes import model_facts, stored_sizes
from shard.placement import Candidate, ModelFacts, PlanError, Problem, RttMatrix, plan
from shard.placement.problem import Sizes
from shard.placement.split import auto_counts, blocks_of, ring_split
from shard.spec.swarm import load_spec
from shard.testing import make_tiny_checkpoint

__all__ = ["family_checkpoint"]  # the fixture, re-exported for pytest

ROOT = Path(__file__).resolve().parents[1]
GEMMA = ROOT / "specs" / "models" / "gemma-3-270m"
FORMATS = ("float32", "bfloat16", "int8", "int4")

Block = tuple[int, int]


def splits(n_layers: int, n_stages: int) -> list[tuple[Block, ...]]:
    """Every way to cut ``n_layers`` into ``n_stages`` contiguous non-empty blocks."""
    found = []
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        edges = (0, *cuts, n_layers)
        found.append(tuple(itertools.pairwise(edges)))
    return found


def brute(prints: Sequence[Footprint], n_layers: int) -> tuple[int, set[tuple[Block, ...]]]:
    """The least largest stage over every contiguous split (stage ``i`` priced by
    ``prints[i].stage``) and the splits that reach it."""
    best, where = None, set()
    for blocks in splits(n_layers, len(prints)):
        worst = max(p.stage(a, b) for p, (a, b) in zip(prints, blocks, strict=True))
        if best is None or worst < best:
            best, where = worst, {blocks}
        elif worst == best:
            where.add(blocks)
    assert best is not None
    return best, where


def sizes(footprint: Footprint) -> Sizes:
    return Sizes(footprint.layers, footprint.embedding, footprint.head, footprint.shared_head)


def auto(prints: Sequence[Footprint]) -> tuple[Block, ...]:
    """What ``layers = "auto"`` picks for stages holding these formats (``auto_counts``)."""
    names = [f"s{i}" for i in range(len(prints))]
    model = ModelFacts.of_sizes(
        sizes(prints[0]), {n: sizes(p) for n, p in zip(names, prints, strict=True)}
    )
    counts = auto_counts(model, names)
    assert counts is not None
    return blocks_of(counts)


def glm_config(tmp_path: Path, n_layers: int = 8, dense: int = 3) -> Path:
    """A tiny GLM-4.5-MoE config.json (transformers' own class), its first ``dense``
    layers dense: no weights."""
    import transformers

    _, _, extra = FAMILIES["glm4_moe"]
    kw = {**BASE, **extra, "num_hidden_layers": n_layers, "first_k_dense_replace": dense}
    out = tmp_path / "glm"
    transformers.Glm4MoeConfig(**kw, vocab_size=300).save_pretrained(out)
    return out


def check_against_brute(config: ModelConfig, formats: Sequence[str]) -> tuple[Block, ...]:
    prints = [predict(config, w, dtype="float32") for w in formats]
    got = auto(prints)
    best, where = brute(prints, config.n_layers)
    assert got in where, f"{formats}: auto {got} is not among the least-bytes splits {where}"
    assert max(p.stage(a, b) for p, (a, b) in zip(prints, got, strict=True)) == best
    return got


@pytest.mark.parametrize("weights", FORMATS)
def test_auto_on_gemma_270m_is_the_brute_force_minimum(weights: str) -> None:
    """On Gemma 3 270M's real config, for 1 to 6 stages, "auto" is a split of least largest
    stage bytes; its embedding (and the last stage's copy of the tied table) is most of the
    model, so the first stage holds one layer where six would be even."""
    config = ModelConfig.from_dir(GEMMA)
    footprint = predict(config, weights, dtype="float32")
    assert footprint.embedding > sum(footprint.layers)  # the table outweighs all 18 layers
    assert footprint.head > footprint.embedding // 2  # tied: the last stage needs a copy
    for n_stages in range(1, 7):
        got = check_against_brute(config, [weights] * n_stages)
        if n_stages == 3:  # the table's stage takes one layer (the head's too, when as big)
            assert got[0] == (0, 1)
            if weights in ("float32", "bfloat16"):
                assert got == ((0, 1), (1, 17), (17, 18))


def test_auto_on_gemma_with_a_format_per_stage_is_the_brute_force_minimum() -> None:
    """Stages holding different formats (each priced as it holds its block): still the
    least largest stage of every split."""
    config = ModelConfig.from_dir(GEMMA)
    rng = random.Random(5)
    for _ in range(6):
        formats = [rng.choice(FORMATS) for _ in range(rng.randint(2, 5))]
        check_against_brute(config, formats)


@pytest.mark.parametrize("weights", FORMATS)
def test_auto_on_a_tiny_moe_with_dense_first_layers(weights: str, tmp_path: Path) -> None:
    """A tiny GLM-4.5-MoE whose first 3 of 8 layers are dense: its dense layers weigh less,
    and "auto" (the brute-force minimum for 1 to 5 stages) gives the first stage more
    layers than the last."""
    config = ModelConfig.from_dir(glm_config(tmp_path))
    footprint = predict(config, weights, dtype="float32")
    assert max(footprint.layers[:3]) < min(footprint.layers[3:])
    for n_stages in range(1, 6):
        got = check_against_brute(config, [weights] * n_stages)
        if n_stages == 3:
            (a, b), _, (c, d) = got
            assert b - a > d - c, got


def test_a_spec_with_auto_layers_resolves_to_the_least_bytes_split(tmp_path: Path) -> None:
    """A spec with ``layers = "auto"`` on Gemma's config resolves (``SwarmSpec.blocks`` with
    the nodes' sizes, what every node computes) to the brute force's split, a stage's own
    ``weights`` priced as it holds it; `swarm up` runs that ring as written and `shard plan
    SPEC` prints those blocks."""
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text((GEMMA / "config.json").read_text())
    spec_path = write_spec(tmp_path, model, {"s1": "int4"})
    spec = load_spec(spec_path)
    config = ModelConfig.from_dir(model)
    blocks = spec.blocks(config.n_layers, model_facts(config, spec, model))
    prints = [predict(config, w, dtype="float32") for w in ("float32", "int4", "float32")]
    _, where = brute(prints, config.n_layers)
    assert blocks in where and blocks == ((0, 1), (1, 17), (17, 18))
    assert spec.blocks(config.n_layers) == ((0, 6), (6, 12), (12, 18))  # no sizes: even
    ran, layout = planned(spec, model, argparse.Namespace(rtt=None, as_written=False))
    assert layout is None and ran == spec
    assert main(["plan", str(spec_path), "--json"]) == 0


def test_shard_plan_spec_prints_the_auto_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shard plan SPEC` on an "auto" spec plans the same blocks as the spec resolves to,
    and `swarm up` runs the spec as written (no ring beats it)."""
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text((GEMMA / "config.json").read_text())
    assert main(["plan", str(write_spec(tmp_path, model, {})), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [(s["first"], s["last"]) for s in found["stages"]] == [(0, 1), (1, 17), (17, 18)]
    assert found["swarm_up"]["layout"] is None


def test_swarm_up_reorders_and_splits_by_bytes(tmp_path: Path) -> None:
    """A spec whose file order pays two slow hops gets the planner's order, and the blocks
    of that order are the least-bytes split (``auto_counts`` over the new order)."""
    model = tmp_path / "glm"
    model.mkdir()
    (model / "config.json").write_text((glm_config(tmp_path) / "config.json").read_text())
    slow = {("coord", "s0"): 20.0, ("s0", "s1"): 20.0}
    spec = load_spec(write_spec(tmp_path, model, {"s2": "int8"}, slow))
    ran, layout = planned(spec, model, argparse.Namespace(rtt=None, as_written=False))
    assert layout is not None and layout.names() != ("s0", "s1", "s2")
    config = ModelConfig.from_dir(model)
    facts = model_facts(config, spec, model)
    counts = auto_counts(facts, layout.names())
    assert counts is not None and [b for _, b in layout.stages] == list(blocks_of(counts))
    assert ran.blocks(config.n_layers, facts) == blocks_of(counts)


def test_smollm2_auto_moves_layers_off_the_embedding_and_head_stages() -> None:
    """SmolLM2's tied embedding weighs 8 of its 30 layers and the last stage holds a copy:
    "auto" on three stages was 10/10/10 (largest stage 18 layers' bytes) and is now 8/15/7
    (16); with two stages it stays 15/15."""
    from shard.convert.bundled import ModelNotFound, resolve_model

    try:
        config = ModelConfig.from_dir(resolve_model("smollm2", progress=False))
    except ModelNotFound as exc:
        pytest.skip(f"bundled model not installed: {exc}")
    footprint = predict(config, "float32")
    assert check_against_brute(config, ["float32"] * 3) == ((0, 8), (8, 23), (23, 30))
    assert check_against_brute(config, ["float32"] * 2) == ((0, 15), (15, 30))
    even = max(footprint.stage(a, b) for a, b in ((0, 10), (10, 20), (20, 30)))
    assert footprint.stage(0, 8) < even


@pytest.mark.parametrize(
    ("spec_file", "want"),
    [
        ("local.toml", ((0, 5), (5, 25), (25, 30))),
        ("gemma.toml", ((0, 1), (1, 17), (17, 18))),
    ],
)
def test_checked_in_stored_specs_resolve_to_the_brute_force_minimum(
    spec_file: str, want: tuple[Block, ...]
) -> None:
    """A checked-in spec over a quantized bundled model (SmolLM2 for every SmolLM2 spec,
    Gemma) resolves as its nodes resolve it (held as stored, each tensor priced as the loader
    installs it) to a split of least largest stage by brute force; these are the blocks
    docs/placement.md and docs/specs.md quote."""
    from shard.convert.bundled import ModelNotFound, resolve_model
    from shard.model.footprint import stored
    from shard.nodes.defaults import with_checkpoint_weights

    spec = load_spec(ROOT / "specs" / spec_file)
    try:
        model = resolve_model(str(spec.model), progress=False)
    except ModelNotFound as exc:
        pytest.skip(f"bundled model not installed: {exc}")
    spec = with_checkpoint_weights(spec, model)
    assert spec.weights == "stored"
    config = ModelConfig.from_dir(model)
    footprint = stored(config, model, dtype=spec.dtype, bf16_kernels=True)
    assert footprint is not None
    _, where = brute([footprint] * len(spec.stages), config.n_layers)
    got = spec.blocks(config.n_layers, model_facts(config, spec, model))
    assert got in where and got == want, (got, where)


def test_a_measured_ring_of_unequal_layers_is_split_within_real_memory() -> None:
    """With measured speeds (formation, an --rtt profile) the ring's split is the slowest
    stage as fast as memory allows, memory counted layer by layer: the brute force over the
    planned ring's order agrees, and every stage fits its node by real bytes."""
    layers = (2, 2, 2, 9, 9, 9, 9, 9)
    model = ModelFacts.of_sizes(Sizes(layers, embedding=6, head=7))
    rng = random.Random(3)
    planned_rings = 0
    for _ in range(40):
        names = [f"n{i}" for i in range(rng.randint(2, 4))]
        nodes = tuple(
            Candidate(n, rng.randint(25, 60), rng.uniform(1, 3), rng.uniform(1, 3)) for n in names
        )
        rtt = RttMatrix.symmetric(
            ["c", *names], {(a, b): 1.0 for a, b in itertools.combinations(["c", *names], 2)}
        )
        try:
            found = plan(Problem(nodes, rtt, model, ("c",)))
        except PlanError:
            continue  # these nodes cannot hold the model
        planned_rings += 1
        ring = [next(c for c in nodes if c.name == s.node) for s in found.stages]
        sizes_ = model.sizes
        assert sizes_ is not None
        best = min(
            (
                max((b - a) * c.ms_per_layer_chunk for c, (a, b) in zip(ring, s, strict=True))
                for s in splits(len(layers), len(ring))
                if all(
                    sizes_.stage(a, b, head_too=i == len(ring) - 1) <= c.memory_bytes
                    for i, (c, (a, b)) in enumerate(zip(ring, s, strict=True))
                )
            ),
            default=None,
        )
        assert best is not None and found.slowest_stage_ms == pytest.approx(best)
        for i, s in enumerate(found.stages):
            held = sizes_.stage(s.first, s.last, head_too=i == len(ring) - 1)
            assert held <= ring[i].memory_bytes
    assert planned_rings >= 20


def test_formation_prices_joined_nodes_layer_by_layer(tmp_path: Path) -> None:
    """A [formation] swarm (``--join``) plans with each layer's real bytes in the swarm's
    format (``shard.nodes.sizes``, what the coordinator hands its scheduler): a tiny MoE's
    dense first layers count small, so the planner splits its rings layer by layer."""
    spec = load_spec(ROOT / "specs" / "formed.toml")
    assert spec.formation is not None and not spec.stages
    directory = glm_config(tmp_path)
    config = ModelConfig.from_dir(directory)
    facts = model_facts(config, spec, directory)
    want = predict(config, spec.weights or spec.dtype, dtype=spec.dtype)
    assert facts.sizes == sizes(want) and facts.node_sizes == ()
    assert not facts.equal_layers and facts.layer_bytes == max(want.layers)
    assert facts.total_bytes == want.total + want.head - want.shared_head


def test_ring_split_by_time_equals_the_brute_force() -> None:
    """``ring_split`` (measured speeds): least slowest stage, within memory by real bytes,
    on 300 seeded rings of unequal layers."""
    rng = random.Random(11)
    for seed in range(300):
        n = rng.randint(1, 9)
        layers = tuple(rng.choice((rng.randint(1, 5), rng.randint(10, 30))) for _ in range(n))
        model = ModelFacts.of_sizes(Sizes(layers, rng.randint(0, 40), rng.randint(0, 40)))
        k = rng.randint(1, n)
        ring = [
            Candidate(f"n{i}", rng.randint(10, 150), rng.uniform(0.5, 3), rng.uniform(0.5, 3))
            for i in range(k)
        ]
        got = ring_split(ring, model, by_bytes=False)
        assert model.sizes is not None
        options = [
            max((b - a) * c.ms_per_layer_chunk for c, (a, b) in zip(ring, s, strict=True))
            for s in splits(n, k)
            if all(
                model.sizes.stage(a, b, head_too=i == k - 1) <= c.memory_bytes
                for i, (c, (a, b)) in enumerate(zip(ring, s, strict=True))
            )
        ]
        if not options:
            assert got is None, f"seed {seed}"
            continue
        assert got is not None, f"seed {seed}"
        worst = max(
            (b - a) * c.ms_per_layer_chunk for c, (a, b) in zip(ring, blocks_of(got), strict=True)
        )
        assert worst == pytest.approx(min(options)), f"seed {seed}"


@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
@pytest.mark.parametrize("family", ["glm4_moe", "gemma3"])
def test_plan_config_uses_the_auto_split_and_its_bytes_are_measured(
    family_checkpoint: Callable[[str], Path],
    family: str,
    weights: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`shard plan --config` on a tiny checkpoint cuts it as a spec's "auto" does (the same
    function), and each planned stage, loaded, holds its predicted bytes within 5 %."""
    path = family_checkpoint(family)
    config = ModelConfig.from_dir(path)
    args = ["plan", "--config", str(path / "config.json"), "--weights", weights]
    assert main([*args, "--dtype", "float32", "--stages", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    planned_blocks = tuple(tuple(s["layers"]) for s in report["stages"])
    assert planned_blocks == auto([predict(config, weights, dtype="float32")] * 3)
    bf16 = kernel_dtype(torch.device("cpu")) is torch.bfloat16
    for stage, (first, last) in zip(report["stages"], planned_blocks, strict=True):
        loaded = load_stage(path, first, last, dtype=torch.float32, config=config, weights=weights)
        got = measured(loaded)
        host = predict(config, weights, dtype="float32", bf16_kernels=bf16).stage(first, last)
        assert abs(got - host) <= 0.05 * got, f"{family} {weights} [{first}, {last})"
        if bf16:  # the plan prices int4 kernels in bf16, as this host holds them
            assert abs(got - stage["bytes"]) <= 0.05 * got


def test_stored_sizes_read_the_checkpoint_headers(tmp_path: Path) -> None:
    """``"stored"`` is sized from the checkpoint's safetensors headers: a float32 tiny
    checkpoint stores what the float32 prediction says, the tied head a copy of the table
    on a stage of its own."""
    path = make_tiny_checkpoint(tmp_path / "tiny", n_layers=4)
    config = ModelConfig.from_dir(path)
    found = stored_sizes(config, path)
    assert found == sizes(predict(config, "float32"))
    assert stored_sizes(config, tmp_path) is None  # no safetensors: priced from the config


def write_spec(
    tmp_path: Path,
    model: Path,
    weights: dict[str, str],
    slow: dict[tuple[str, str], float] | None = None,
) -> Path:
    """A three-stage "auto" spec over ``model`` (stage ``name`` holding ``weights[name]``),
    1 ms links but the ``slow`` ones."""
    body = [
        f'[swarm]\nname = "t"\nmodel = "{model}"\ninsecure = true\n',
        '[coordinator]\nname = "coord"\nlisten = "127.0.0.1:7900"\n',
    ]
    for i in range(3):
        body.append(
            f'[[stage]]\nname = "s{i}"\nlisten = "127.0.0.1:{7901 + i}"\nlayers = "auto"\n'
            + (f'weights = "{weights[f"s{i}"]}"\n' if f"s{i}" in weights else "")
        )
    body.append("[links]\nlatency_ms = 1.0\n")
    for (a, b), ms in (slow or {}).items():
        body.append(f'[[links.edge]]\nfrom = "{a}"\nto = "{b}"\nlatency_ms = {ms}\n')
    path = tmp_path / "swarm.toml"
    path.write_text("".join(body))
    return path
