"""Two versions of the code, A and B, under ``shard bench``: medians over alternating runs.

``shard bench`` compares drafts and modes side by side in one run; a change to the
coordinator's controller is a comparison across commits, which one run cannot hold. So the
runs alternate (A, B, A, B, …, each a full ``shard bench`` of its own commit, e.g. B from a
``git worktree`` with ``PYTHONPATH=WORKTREE/src``) and this script reads their JSON, groups
them by commit, and reports per (set, mode, draft): the median decode tok/s and its ×-plain
over the runs, and the median drafted tokens, accepted tokens and decode seconds per prompt —
what a controller change moves even where tok/s is noise.

    .venv/bin/python bench/speculation_ab.py --label new=RUN.json,... --label old=RUN.json,... \
        [--json bench/results/spec_ab.json]

Writes one JSON (per label: commit, each run's date, load and ``summary`` rows, the medians;
not the runs' per-token records); prints a Markdown table. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

Key = tuple[str, str, str]  # (set, mode, draft)


def summarise(paths: list[Path]) -> dict[str, Any]:
    """The medians over the runs of one label (every run from the same commit)."""
    runs = [json.loads(p.read_text()) for p in paths]
    commits = {r["git"]["commit"] for r in runs}
    if len(commits) != 1:
        raise SystemExit(f"runs of one label come from {len(commits)} commits: {sorted(commits)}")
    tok_s: dict[Key, list[float]] = defaultdict(list)
    ratio: dict[Key, list[float]] = defaultdict(list)
    per_prompt: dict[Key, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for s in run["summary"]:
            key = (s["set"], s["mode"], s["draft"] or "-")
            tok_s[key].append(s["decode_tok_s"])
            if s["ratio_decode_tok_s"] is not None:
                ratio[key].append(s["ratio_decode_tok_s"])
        for r in run["runs"]:
            key = (r["set"], r["mode"], r["draft"] or "-")
            for field in ("drafted", "accepted", "decode_s", "tokens_per_chunk"):
                if r.get(field) is not None:
                    per_prompt[key][field].append(r[field])
    return {
        "commit": commits.pop(),
        "dirty_files": sorted({r["git"]["dirty_files"] for r in runs}),
        "runs": [
            {
                "file": p.name,
                "date": r["date"],
                "wall_s": r["wall_s"],
                "load": r["loadavg_start"],
                "summary": r["summary"],
            }
            for p, r in zip(paths, runs, strict=True)
        ],
        "median": [
            {
                "set": k[0],
                "mode": k[1],
                "draft": k[2],
                "runs": len(v),
                "decode_tok_s": statistics.median(v),
                "x_plain": statistics.median(ratio[k]) if ratio[k] else None,
                **{f: statistics.median(xs) for f, xs in per_prompt[k].items()},
            }
            for k, v in sorted(tok_s.items())
        ],
    }


def table(labels: dict[str, dict[str, Any]]) -> str:
    names = list(labels)
    rows: dict[Key, dict[str, Any]] = {}
    for n in names:
        for m in labels[n]["median"]:
            rows.setdefault((m["set"], m["mode"], m["draft"]), {})[n] = m
    head = "| set | mode | draft | " + " | ".join(
        f"{n}: tok/s (× plain), drafted / accepted per prompt" for n in names
    )
    out = [head + " |", "|---|---|---|" + "---|" * len(names)]
    for (s, mode, draft), by in rows.items():
        cells = []
        for n in names:
            m = by.get(n)
            if m is None:
                cells.append("–")
                continue
            x = f" ({m['x_plain']:.1f}×)" if m["x_plain"] is not None else ""
            dr = f", {m['drafted']:.0f} / {m['accepted']:.0f}" if "drafted" in m else ""
            cells.append(f"{m['decode_tok_s']:.1f}{x}{dr}")
        out.append(f"| {s} | {mode} | {draft} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--label", action="append", required=True, help="NAME=RUN.json,RUN.json,… (repeatable)"
    )
    ap.add_argument("--json", type=Path, help="write the medians here")
    args = ap.parse_args()
    labels: dict[str, dict[str, Any]] = {}
    for spec in args.label:
        name, _, files = spec.partition("=")
        if not name or not files:
            raise SystemExit(f"--label wants NAME=RUN.json,…, not {spec!r}")
        labels[name] = summarise([Path(f) for f in files.split(",")])
    print(table(labels))
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "spec_ab", "labels": labels}, indent=1))


if __name__ == "__main__":
    main()
