"""shard.testing: test support, public like ``structlog.testing`` — other packages' tests may use
it; nothing else in ``src`` imports it.

    checkpoints.py  ``make_tiny_checkpoint``: tiny, deterministic, random-weight Hugging Face
                    checkpoints that shard and transformers both load
    eagle3.py       ``write_eagle3_head``: a tiny random EAGLE-3 head in its published
                    layout (SpecForge's config keys, tensor names, ``d2t``/``t2d``)
    cheats.py       cheating stages for spot-check tests (``cheating``, ``CheatingBlock``,
                    ``batched_lies``, a tail that overstates, an audit tap)
    nat.py          a firewall and a tampering relay for NAT tests (``Firewall``,
                    ``TamperingHub``)
    requests.py     ``generate_watching``: a request whose committed tokens a test watches
    faults.py       deterministic fault injection: a seeded ``FaultPlan`` applied by a
                    ``FaultyNetwork`` (``FaultInjector``), in virtual time
    snapshots.py    fixed status snapshots for monitor tests, snapshot tests and demos
                    (``sample_snapshot``, ``T0``)
    swarm_world.py  a seeded synthetic swarm: regions and round trips, cards, Poisson joins,
                    Weibull sessions (``World.generate``)
    swarm_sim.py    ``simulate``: a ``World`` formed, placed and repaired by the real scheduler
                    in virtual time, one ``ControlClient`` per simulated node (issue 40)
    cheat_node.py   ``python -m shard.testing.cheat_node KIND NODE ARGS``: ``shard ARGS`` with one
                    node's block cheating (process tests of audits)
    nat_node.py     ``python -m shard.testing.nat_node MODE ARGS``: ``shard ARGS`` with the relay
                    role held by a tampering hub (process tests of sealed NAT edges)
"""

from shard.testing.cheats import CHEATS, AuditTap, CheatingBlock, OverstatingTail, cheating
from shard.testing.checkpoints import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    make_tiny_checkpoint,
    scale_upper_layers,
    tiny_tokenizer,
)
from shard.testing.nat import Firewall, TamperingHub
from shard.testing.requests import generate_watching

__all__ = [
    "CHAT_TEMPLATE",
    "CHEATS",
    "SPECIAL_TOKENS",
    "AuditTap",
    "CheatingBlock",
    "Firewall",
    "OverstatingTail",
    "TamperingHub",
    "cheating",
    "generate_watching",
    "make_tiny_checkpoint",
    "scale_upper_layers",
    "tiny_tokenizer",
]
