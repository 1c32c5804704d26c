"""The benchmark's options (its command line, declared in ``shard.cli.args.bench``, checked
here) and its prompt-set file.

The prompt file is TOML, one ``[[prompt]]`` table per prompt::

    [[prompt]]
    set = "copy"          # the prompt set: results are summarised per set
    name = "copy-repeat"  # unique
    chat = true           # wrap the text in the model's chat template (default false)
    text = "Repeat the following text exactly: ..."
"""

from __future__ import annotations

import datetime
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

MODES: Final = ("plain", "spec", "pipelined")
DRAFTS: Final = (
    "ngram",
    "best",
    "head",
    "hybrid",
    "hybrid_chain",
    "mtp",
    "mtp_coordinator",
    "oracle",
)
#: What a run compares unless --drafts says otherwise (the head and the hybrid need a trained
#: head: ``shard draft train``, or --head DIR).
DEFAULT_DRAFTS: Final = ("ngram", "best", "oracle")

DESCRIPTION = """\
Plain, speculative (D = 1) and speculative + pipelined decoding, side by side in one run,
through rings of stage processes on this machine (a coordinator and the spec's stages, each
its own process, latency emulated per edge by a user-space delaying relay), with the n-gram
draft, the best model draft and the ORACLE draft: a ceiling, not a draft. The oracle replays
the single-process reference output recorded at the start of the run at no cost (alpha = 1),
which isolates the engine's efficiency from draft quality.

Per latency every draft gets its own ring (derived from SPEC: same model, stages, layers and
limits; free loopback ports; [links] latency_ms = L on every edge; [speculation] draft = the
draft). Plain decoding runs on the first ring with k = 0. Per prompt, in order: a 1-token
probe on every ring (prefill only: its compute is subtracted to leave decode compute), plain,
then spec and pipelined per draft. Modes: plain = k 0; spec = the spec's K policy with
depth 1; pipelined = the spec's K and depth policy. The oracle uses fixed K = k_max and
D = depth_max (alpha = 1 is known: there is nothing to adapt) unless --oracle-policy spec.

Every run is recorded with tok/s (end to end and decode only), alpha, tokens per lap, lap
time, per-stage compute, per-edge transit, its analytical bound (docs/benchmarks.md) and
whether its tokens equal the single-process reference's (recorded, never asserted).
Writes JSON (--json; default a new bench/results/spec_ring-<UTC time>.json) and a PNG plot of
decode tok/s against latency (--plot; needs matplotlib, e.g. pip install -e '.[bench]'),
prints Markdown tables. Never replaces an existing file (committed results) unless --force.
Needs an insecure spec.
"""


@attrs.frozen
class Prompt:
    """One benchmark prompt; ``chat`` sends it through the model's chat template."""

    name: str
    set: str
    text: str
    chat: bool = False


@attrs.frozen
class Options:
    """Everything a run needs, parsed and checked."""

    spec: Path
    prompts_file: Path
    prompts: tuple[Prompt, ...]
    modes: tuple[str, ...]
    drafts: tuple[str, ...]
    latencies_ms: tuple[float, ...]
    max_tokens: int
    best_draft: str
    best_layers: tuple[int, ...]
    model: str | None
    json_out: Path
    plot_out: Path | None
    threads: int
    request_timeout_s: float
    oracle_policy: str
    ignore_eos: bool = False  # every request runs max_tokens: EOS does not stop it
    head: str | None = None  # the head and hybrid drafts' head (None: <model>-head)


class OptionsError(Exception):
    """A bad flag or prompt file: one line saying what and where."""


FLAGS: Final = (
    "spec", "prompts", "modes", "drafts", "head", "latencies", "max_tokens", "sets", "per_set",
    "best_draft", "best_layers", "model", "json", "plot", "ignore_eos", "force", "threads",
    "request_timeout", "oracle_policy",
)  # fmt: skip
"""The command line's values ``options`` takes (``shard.cli.args.bench`` declares them)."""


def options(
    flags: Mapping[str, Any], *, root: Path, now: datetime.datetime | None = None
) -> Options:
    """Check the command line's values (``FLAGS``, as parsed); default paths resolve against
    ``root`` (the repository), and the default output is named after ``now`` (UTC; default the
    current time).

    Errors: ``OptionsError`` for bad values, a bad prompt file, or an output file that exists
    without ``--force``.
    """
    f = {name: flags[name] for name in FLAGS}
    modes = _choices(f["modes"], MODES, "--modes")
    drafts = _choices(f["drafts"], DRAFTS, "--drafts")
    try:
        latencies = tuple(float(x) for x in f["latencies"].split(",") if x.strip())
        layers = tuple(int(x) for x in f["best_layers"].split(",") if x.strip())
    except ValueError as exc:
        raise OptionsError(f"--latencies / --best-layers: {exc}") from None
    if not latencies or any(not 0 <= x <= 10_000 for x in latencies):
        raise OptionsError("--latencies: give one or more milliseconds in 0..10000, e.g. 0,25")
    if any(n < 1 for n in layers):
        raise OptionsError("--best-layers: layer counts are >= 1")
    prompts_file: Path = f["prompts"] or root / "bench/prompts/spec_ring.toml"
    prompts = load_prompts(prompts_file, sets=f["sets"], per_set=f["per_set"])
    json_out: Path = f["json"] or default_output(root, now)
    plot = None if f["plot"] == "none" else Path(f["plot"] or json_out.with_suffix(".png"))
    if not f["force"]:
        for path in (json_out, plot):
            if path is not None and path.exists():
                raise OptionsError(
                    f"{path} exists (committed results?); write elsewhere with --json/--plot, "
                    "or pass --force to replace it"
                )
    return Options(
        spec=f["spec"] or root / "specs/local.toml",
        prompts_file=prompts_file,
        prompts=prompts,
        modes=modes,
        drafts=drafts,
        latencies_ms=latencies,
        max_tokens=f["max_tokens"],
        best_draft=f["best_draft"],
        best_layers=layers,
        model=f["model"],
        json_out=json_out,
        plot_out=plot,
        threads=f["threads"],
        request_timeout_s=f["request_timeout"],
        oracle_policy=f["oracle_policy"],
        ignore_eos=f["ignore_eos"],
        head=f["head"],
    )


def default_output(root: Path, now: datetime.datetime | None = None) -> Path:
    """``root/bench/results/spec_ring-<UTC time>.json``: a new name per run, so a default run
    never replaces committed results."""
    stamp = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y%m%dT%H%M%SZ")
    return root / "bench" / "results" / f"spec_ring-{stamp}.json"


def _choices(text: str, allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    picked = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in picked if x not in allowed]
    if bad or not picked:
        raise OptionsError(f"{flag}: {', '.join(bad) or 'empty'}; use some of {','.join(allowed)}")
    return tuple(x for x in allowed if x in picked)


def load_prompts(path: Path, *, sets: str = "", per_set: int = 0) -> tuple[Prompt, ...]:
    """The prompts of ``path`` in file order, filtered by set names and a per-set cap.

    Errors: ``OptionsError`` naming the file and the prompt.
    """
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise OptionsError(f"{path}: {exc}") from None
    tables = data.get("prompt")
    if not isinstance(tables, list) or not tables:
        raise OptionsError(f"{path}: no [[prompt]] tables")
    prompts: list[Prompt] = []
    for i, t in enumerate(tables):
        where = f"{path}: prompt[{i}]"
        if not isinstance(t, dict) or set(t) - {"set", "name", "text", "chat"}:
            raise OptionsError(f"{where}: keys are set, name, text, chat")
        fields = {k: t.get(k) for k in ("set", "name", "text")}
        if not all(isinstance(v, str) and v for v in fields.values()):
            raise OptionsError(f"{where}: set, name and text must be non-empty strings")
        if not isinstance(t.get("chat", False), bool):
            raise OptionsError(f"{where}: chat must be true or false")
        prompts.append(Prompt(t["name"], t["set"], t["text"], t.get("chat", False)))
    names = [p.name for p in prompts]
    if len(set(names)) != len(names):
        raise OptionsError(f"{path}: prompt names must be unique")
    wanted = {s.strip() for s in sets.split(",") if s.strip()}
    if wanted - {p.set for p in prompts}:
        raise OptionsError(f"--sets: {path} has no set {sorted(wanted - {p.set for p in prompts})}")
    kept: list[Prompt] = []
    for p in prompts:
        same = sum(q.set == p.set for q in kept)
        if (not wanted or p.set in wanted) and (per_set <= 0 or same < per_set):
            kept.append(p)
    return tuple(kept)
