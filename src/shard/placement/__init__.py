"""shard.placement: which nodes form the ring, in which order, holding which layers, with the
coordinator where — as pure functions of measured inputs (no I/O, no Trio, no torch).

``problem.py`` holds the inputs (candidates with memory and compute profiles, the RTT matrix,
the model's size, coordinator locations, boundary pinning) and ``PlanError``; ``lap.py`` the
lap model and the ``Plan`` it scores; ``split.py`` the block split (slowest stage as fast as
memory allows, layer by layer in real bytes; or the largest stage's bytes least: ``layers =
"auto"``); ``search.py`` the exact search (Held–Karp over subsets, up to
``EXACT_LIMIT`` candidates) and ``heuristic.py`` the stated rule beyond it; ``planner.py``
``plan()`` and the alternatives it beat; ``replan.py`` the sticky re-plan after a failure;
``geography.py`` reads a geography (nodes + RTT matrix) from parsed TOML or JSON;
``report.py`` prints a plan; ``emulate.py`` writes a plan as a loopback swarm spec whose
hops carry the plan's one-way latencies (to measure its lap against the prediction).
Imports nothing of shard but ``shard.errors``. The lap model and its limits are described in
``docs/placement.md``.
"""

from shard.placement.geography import Geography, read_geography
from shard.placement.heuristic import EXACT_LIMIT
from shard.placement.lap import Alternative, Hop, Plan, Stage
from shard.placement.planner import baseline, plan
from shard.placement.problem import Candidate, ModelFacts, PlanError, Problem, RttMatrix
from shard.placement.replan import replan

__all__ = [
    "EXACT_LIMIT",
    "Alternative",
    "Candidate",
    "Geography",
    "Hop",
    "ModelFacts",
    "Plan",
    "PlanError",
    "Problem",
    "RttMatrix",
    "Stage",
    "baseline",
    "plan",
    "read_geography",
    "replan",
]
