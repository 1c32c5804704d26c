"""``run_bench``: references and drafts first (this process), then the sweep, then the JSON,
the Markdown tables and the plot."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from shard.cli.benchmark import drafts, report
from shard.cli.benchmark.bound import __doc__ as BOUND_DOC
from shard.cli.benchmark.options import Options, OptionsError
from shard.cli.benchmark.ringspec import BenchSpecError, RingBase, Speculation, check_base, policy
from shard.cli.benchmark.sweep import Plan, progress, sweep
from shard.convert.bundled import resolve_model
from shard.decode.draft import NGramProposer
from shard.spec.swarm import SpecError, SwarmSpec, load_spec

Record = dict[str, Any]
DESIGN_LATENCY_MS = 25.0  # the latency the best draft is chosen for


def run_bench(opts: Options, *, prog: str = "shard bench") -> int:
    """Run the benchmark ``opts`` describe (``shard.cli.bench`` parses them); returns an exit
    code (1 with one line on a bad spec or a missing head)."""
    try:
        base = load_spec(opts.spec)
        check_base(base)
        if {"head", "hybrid", "hybrid_chain"} & set(opts.drafts):  # before minutes of references
            opts = attrs.evolve(opts, head=str(_head_dir(opts, base)))
    except (OptionsError, SpecError, BenchSpecError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    # While a ring starts, its relays see nodes that do not listen yet and warn each time;
    # a relay failing mid-run fails a request, which is an error of its own.
    logging.getLogger("shard.transport.relay").setLevel(logging.ERROR)
    machine = machine_info()  # before the thread count changes
    if opts.threads > 0:
        import torch

        torch.set_num_threads(opts.threads)
    began, load_start = time.perf_counter(), os.getloadavg()
    model_dir = resolve_model(opts.model or base.model)
    with tempfile.TemporaryDirectory(prefix="shard-bench-") as tmp:
        workdir = Path(tmp)
        plan, picked = _prepare(opts, base, model_dir, workdir)
        with open(workdir / "nodes.log", "wb") as log:
            try:
                runs, rings = trio.run(sweep, attrs.evolve(plan, log=log))
            except BaseException:
                print(f"{prog}: the nodes' log:\n{_tail(workdir / 'nodes.log')}", file=sys.stderr)
                raise
    rows = report.summarize(runs)
    result = {
        "benchmark": "spec_ring",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "cwd": os.getcwd(),
        "wall_s": time.perf_counter() - began,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "git": git_info(),
        "machine": machine,
        "config": _config(opts, base, model_dir, plan),
        "bound_formulas": BOUND_DOC,
        "references": [_reference_record(r) for r in plan.references.values()],
        "drafts": picked,
        "rings": rings,
        "summary": rows,
        "runs": runs,
    }
    opts.json_out.parent.mkdir(parents=True, exist_ok=True)
    opts.json_out.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print("## All prompts (medians)\n\n" + report.table(rows))
    print("\n## Decode tok/s by prompt set (× plain at the same latency)\n\n" + report.by_set(rows))
    progress(f"wrote {opts.json_out}")
    if opts.plot_out is not None:
        try:
            report.plot(rows, opts.plot_out, f"shard bench, {machine['cpu']}, {result['date']}")
            progress(f"wrote {opts.plot_out}")
        except ImportError:
            progress("no plot: matplotlib is not installed (pip install -e '.[bench]')")
    return 0


def _prepare(opts: Options, base: SwarmSpec, model_dir: Path, workdir: Path) -> tuple[Plan, Record]:
    """References, the oracle file, the best draft and each ring's [speculation]."""
    progress(f"single-process references: {len(opts.prompts)} prompts")
    refs, model = drafts.run_references(
        model_dir, opts.prompts, opts.max_tokens, base.limits, ignore_eos=opts.ignore_eos
    )
    del model  # the rings need the memory
    oracle = workdir / "oracle.json"
    drafts.write_oracle(oracle, refs)
    hits, guessed, positions = drafts.ngram_agreement(refs)
    context = [*refs[0].prompt_ids, *refs[0].output_ids]
    pol = policy(base)
    speculation: dict[str, Speculation] = {"ngram": {"draft": "ngram", **pol}}
    cost = {"ngram": drafts.token_cost(NGramProposer, context), "oracle": 0.0}
    fixed = {"k": base.speculation.policy.k_max, "depth": base.speculation.policy.depth_max}
    speculation["oracle"] = {
        "draft": "oracle",
        "oracle_file": str(oracle),
        **pol,
        **(fixed if opts.oracle_policy == "fixed" else {}),
    }
    picked: Record = {
        "ngram": {"alpha1": hits / max(guessed, 1), "coverage": guessed / max(positions, 1)},
        "ngram_token_s": cost["ngram"],
    }
    if {"head", "hybrid", "hybrid_chain"} & set(opts.drafts):
        head = _head_dir(opts, base)
        token_s = _head_token_s(head)
        for kind in ("head", "hybrid"):
            speculation[kind] = {"draft": kind, "draft_head": str(head), **pol}
            cost[kind] = token_s  # the hybrid's copied tokens are free: an upper bound
        # the hybrid as it was before branches (docs/drafts.md): its chunks only
        speculation["hybrid_chain"] = {**speculation["hybrid"], "branch": False}
        cost["hybrid_chain"] = token_s
        picked.update(head=str(head), head_token_s=token_s)
    if "mtp" in opts.drafts:  # the tail drafts: its block's steps show in its compute
        speculation["mtp"] = {"draft": "mtp", "mtp_at": "tail", **pol}
    if "mtp_coordinator" in opts.drafts:  # no cost recorded: the bound leaves it out
        speculation["mtp_coordinator"] = {"draft": "mtp", "mtp_at": "coordinator", **pol}
    if "best" in opts.drafts:
        best, candidates = _best_draft(opts, base, model_dir, refs)
        speculation["best"] = {**best.speculation, **pol}
        cost["best"] = best.token_s
        picked.update(best=best.label, candidates=[attrs.asdict(c) for c in candidates])
    plan = Plan(
        opts=opts,
        base=RingBase.of(base),
        model_dir=model_dir,
        references={r.prompt.name: r for r in refs},
        speculation=speculation,
        draft_token_s=cost,
        cores=len(os.sched_getaffinity(0)),
        workdir=workdir,
        log=sys.stderr.buffer,
    )
    return plan, picked


def _best_draft(
    opts: Options, base: SwarmSpec, model_dir: Path, refs: list[drafts.Reference]
) -> tuple[drafts.Candidate, list[drafts.Candidate]]:
    """The candidate with the highest predicted D = 1 rate at ``DESIGN_LATENCY_MS``."""
    if opts.best_draft == "auto":
        pool = drafts.candidates(model_dir, opts.best_layers)
    else:
        pool = [drafts.parse_best(opts.best_draft, model_dir)]
    hops = len(base.stages) + 1
    step = sorted(r.step_s for r in refs)[len(refs) // 2]
    lap = hops * DESIGN_LATENCY_MS / 1000.0 + step
    measured = []
    for label, spec in pool:
        c = drafts.measure(
            label, spec, model_dir, refs, lap_s=lap, k_max=base.speculation.policy.k_max
        )
        progress(
            f"draft {label}: alpha1 {c.alpha1:.2f}, {1000 * c.token_s:.1f} ms/token, "
            f"predicted {c.predicted_tok_s:.1f} tok/s at K={c.predicted_k}"
        )
        measured.append(c)
    return max(measured, key=lambda c: c.predicted_tok_s), measured


def _reference_record(r: drafts.Reference) -> Record:
    return {
        "prompt": r.prompt.name,
        "set": r.prompt.set,
        "chat": r.prompt.chat,
        "text_in": r.prompt.text,
        "prompt_tokens": len(r.prompt_ids),
        "token_ids": list(r.output_ids),
        "text": r.text,
        "finish_reason": r.finish_reason,
        "single_step_s": r.step_s,
        "single_tok_s": r.tok_s,
    }


def _config(opts: Options, base: SwarmSpec, model_dir: Path, plan: Plan) -> Record:
    return {
        "base_spec": str(opts.spec),
        "prompts_file": str(opts.prompts_file),
        "model": str(model_dir),
        "dtype": base.dtype,
        "stages": [s.name for s in base.stages],
        "modes": list(opts.modes),
        "drafts": list(opts.drafts),
        "latencies_ms": list(opts.latencies_ms),
        "max_tokens": opts.max_tokens,
        "ignore_eos": opts.ignore_eos,
        "sampling": "greedy (temperature 0)",
        "speculation": {d: dict(s) for d, s in plan.speculation.items() if d in opts.drafts},
        "draft_token_s": dict(plan.draft_token_s),
        "cores_shared_by_the_rings": plan.cores,
        "oracle_policy": opts.oracle_policy,
        "threads_driver": opts.threads or "torch default",
        # what shard.nodes.launcher.launch gives each node (``shard up --threads``)
        "threads_per_node": max(1, (os.cpu_count() or 1) // (len(base.stages) + 1)),
        "order": "per latency: rings up, warm-ups; per prompt: probes, plain, then spec and "
        "pipelined per draft",
    }


def machine_info() -> Record:
    import torch

    cpu = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": "none used (everything runs on the CPU)",
        "torch": torch.__version__,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "latency": "emulated by shard's user-space delaying relay on loopback, one per edge",
    }


def git_info() -> Record:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
        return out.stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty_files": len(git("status", "-s").splitlines()),
    }


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def _head_dir(opts: Options, base: SwarmSpec) -> Path:
    """The head the head and hybrid drafts use: ``--head`` (a trained head's name or
    directory, or an EAGLE-3 head's: a shipped name such as ``smollm2-eagle3`` or a
    directory), else ``<model>-head`` (never built here: a bench run that trains for minutes
    first would time everything wrong)."""
    from shard.decode.head.shipped import is_eagle3_dir, shipped_head
    from shard.training.head.cache import HeadNotFound, resolve_head

    name = opts.head or f"{base.model}-head"
    if (shipped := shipped_head(name)) is not None:
        return shipped
    if is_eagle3_dir(Path(name).expanduser()):
        return Path(name).expanduser().resolve()
    try:
        return resolve_head(name, build=False)
    except HeadNotFound as exc:
        raise OptionsError(f"--drafts head/hybrid: {exc}") from None


def _head_token_s(head: Path) -> float:
    """Seconds per drafted token, as the head's training run measured it (0: not recorded)."""
    try:
        report = json.loads((head / "train.json").read_text(encoding="utf-8"))
        return float(report["measured"]["draft_ms"]) / 1000.0
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
