"""A synthetic swarm for simulation: who joins when, from where, with which card, for how long.

Pure and seeded (``World.generate(n, seed)``): the same seed gives the same world. What it
draws, and why:

- **Geography**: six regions with the round trips between them (ms, the order of magnitude
  of public inter-region pings between cloud regions); within a region 4–30 ms; each node adds
  its own access latency (2–25 ms: home broadband to data centre), so
  ``rtt(a, b) = base(region a, region b) + access a + access b``, symmetric.
- **Cards**: a mix of consumer and data-centre GPUs, each with the memory it offers for
  weights and its measured ms per layer (``CARDS``).
- **Loading**: each node has the weights on its disk already (fetched when it first joined)
  and loads a block at a bandwidth drawn log-uniform between 200 MB/s and 2 GB/s (SATA SSD to
  NVMe): an ``Activate`` takes block bytes / bandwidth. (Fetching a 20 GiB block over the WAN
  at 100 Mbit/s would take half an hour: another regime, not simulated here.)
- **Joins**: a Poisson process with ``n`` arrivals in ``join_window_s`` (given its count,
  uniform times); after the window, arrivals keep coming at the steady-state rate
  ``n / mean session``, so the swarm's size stays about ``n``.
- **Sessions**: Weibull with shape ``SESSION_SHAPE`` = 0.5 and median ``median_session_s``
  (1 h by default). Measured P2P session lengths fit a Weibull of shape 0.34–0.59 (Stutzbach
  and Rejaie, "Understanding Churn in Peer-to-Peer Networks", IMC 2006: Gnutella, Kad,
  BitTorrent): many short sessions, a long tail. A fraction ``silent`` of the ends are silent
  (the machine or its network is gone: the failure detector must notice), the rest close their
  links (a process that exits).
"""

from __future__ import annotations

import math
import random

import attrs

#: Regions and the round trip (ms) between them (upper triangle; symmetric).
REGIONS = ("us-east", "us-west", "eu-west", "eu-central", "asia-east", "sa-east")
_INTER_MS = {
    ("us-east", "us-west"): 65.0,
    ("us-east", "eu-west"): 75.0,
    ("us-east", "eu-central"): 90.0,
    ("us-east", "asia-east"): 160.0,
    ("us-east", "sa-east"): 115.0,
    ("us-west", "eu-west"): 140.0,
    ("us-west", "eu-central"): 150.0,
    ("us-west", "asia-east"): 105.0,
    ("us-west", "sa-east"): 175.0,
    ("eu-west", "eu-central"): 20.0,
    ("eu-west", "asia-east"): 220.0,
    ("eu-west", "sa-east"): 185.0,
    ("eu-central", "asia-east"): 230.0,
    ("eu-central", "sa-east"): 200.0,
    ("asia-east", "sa-east"): 260.0,
}
#: How many of the swarm's nodes each region holds (weights).
_REGION_SHARE = (0.25, 0.15, 0.15, 0.2, 0.18, 0.07)

#: (label, GiB offered for weights, ms per layer for a one-token chunk, for a verify chunk,
#: share of the swarm), for one layer of ``Model`` (about 1 GiB: a frontier MoE in int4).
CARDS = (
    ("rtx3060-12g", 10.0, 2.4, 2.8, 0.25),
    ("rtx3090-24g", 21.0, 1.3, 1.5, 0.25),
    ("rtx4090-24g", 21.0, 0.9, 1.0, 0.25),
    ("a6000-48g", 44.0, 1.1, 1.2, 0.15),
    ("a100-80g", 76.0, 0.6, 0.65, 0.10),
)

GIB = 1 << 30
#: Weibull shape of session lengths (see the module docstring).
SESSION_SHAPE = 0.5


@attrs.frozen
class SimNode:
    """One simulated node: where it is, its card, when it joins and how long it stays."""

    name: str
    region: str
    access_ms: float
    card: str
    memory_bytes: int
    ms_one: float
    ms_chunk: float
    load_bytes_s: float
    join_at: float
    session_s: float
    silent: bool

    @property
    def leave_at(self) -> float:
        return self.join_at + self.session_s


@attrs.frozen
class Model:
    """What the simulated ring holds: ``n_layers`` equal layers and the two ends (99 GiB
    by default: no card holds it alone, so rings have several stages)."""

    n_layers: int = 96
    layer_bytes: int = 1 * GIB
    embedding_bytes: int = int(1.5 * GIB)
    head_bytes: int = int(1.5 * GIB)


def region_rtt_ms(a: str, b: str, intra_ms: float) -> float:
    """The base round trip between two regions (``intra_ms`` within one)."""
    if a == b:
        return intra_ms
    return _INTER_MS.get((a, b)) or _INTER_MS[(b, a)]


@attrs.frozen
class World:
    """The coordinator's region, every node that ever joins (in join order) and the model."""

    seed: int
    coordinator_region: str
    nodes: tuple[SimNode, ...]
    model: Model
    intra_ms: tuple[float, ...]  # per region, in REGIONS order
    _by_name: dict[str, SimNode] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {n.name: n for n in self.nodes})

    def node(self, name: str) -> SimNode:
        return self._by_name[name]

    def rtt_ms(self, a: str, b: str) -> float:
        """The round trip between two nodes, or a node and the coordinator (``"coord"``)."""
        if a == b:
            return 0.0
        ra, aa = self._where(a)
        rb, ab = self._where(b)
        intra = self.intra_ms[REGIONS.index(ra)] if ra == rb else 0.0
        return region_rtt_ms(ra, rb, intra) + aa + ab

    def _where(self, name: str) -> tuple[str, float]:
        node = self._by_name.get(name)
        if node is None:  # the coordinator: in its region, on a data-centre link
            return self.coordinator_region, 1.0
        return node.region, node.access_ms

    @classmethod
    def generate(
        cls,
        n: int,
        seed: int,
        *,
        join_window_s: float = 120.0,
        horizon_s: float = 600.0,
        median_session_s: float = 3600.0,
        silent: float = 0.5,
        coordinator_region: str = "eu-central",
        model: Model = Model(),
    ) -> World:
        """``n`` nodes joining over ``join_window_s``, then steady-state arrivals until
        ``horizon_s`` (see the module docstring)."""
        rng = random.Random(seed)
        intra = tuple(rng.uniform(4.0, 30.0) for _ in REGIONS)
        # Weibull: median = scale * ln(2) ** (1 / shape)
        scale = median_session_s / math.log(2) ** (1 / SESSION_SHAPE)
        mean = scale * math.gamma(1 + 1 / SESSION_SHAPE)
        # n arrivals in the window: a Poisson process given its count (uniform times)
        times = sorted(rng.uniform(0.0, join_window_s) for _ in range(n))
        t = join_window_s
        while True:  # then the steady-state rate, which replaces the nodes that leave
            t += rng.expovariate(n / mean)
            if t >= horizon_s or len(times) >= 10 * n:
                break
            times.append(t)
        nodes = [_draw(rng, f"n{i:04d}", at, scale, silent) for i, at in enumerate(times)]
        return cls(seed, coordinator_region, tuple(nodes), model, intra)


def _draw(rng: random.Random, name: str, join_at: float, scale: float, silent: float) -> SimNode:
    region = rng.choices(REGIONS, weights=_REGION_SHARE)[0]
    card, gib, one, chunk, _ = rng.choices(CARDS, weights=[c[4] for c in CARDS])[0]
    return SimNode(
        name=name,
        region=region,
        access_ms=round(rng.uniform(2.0, 25.0), 2),
        card=card,
        memory_bytes=int(gib * GIB),
        ms_one=one,
        ms_chunk=chunk,
        load_bytes_s=math.exp(rng.uniform(math.log(200e6), math.log(2e9))),
        join_at=join_at,
        session_s=rng.weibullvariate(scale, SESSION_SHAPE),
        silent=rng.random() < silent,
    )


__all__ = ["CARDS", "GIB", "REGIONS", "SESSION_SHAPE", "Model", "SimNode", "World"]
