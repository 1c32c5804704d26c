"""The package layout is enforced: what each layer may import, read from the source (every
``import``, function-local ones included), so a forbidden import fails here before it ships.

The rules (each package's ``__init__`` docstring says the same):

- ``shard.model`` is the model runtime: it imports no other shard package (but the strict JSON
  parser, ``shard.strict_json``, which imports nothing) and nothing of the network (no trio,
  WebSockets, msgpack or zstd);
- ``shard.wire`` is the one frame codec: it imports only ``shard.messages`` and ``shard.errors``;
- ``shard.messages`` is plain data and imports no other shard package; ``shard.spec`` is plain
  data too (no torch, no network), reading public keys with ``shard.trust.identity``,
  building the K/D policy record of ``shard.decode.control`` (a pure module), finding shipped
  draft heads with ``shard.decode.head.shipped`` (pure) and planning its ring with
  ``shard.placement`` (pure: ``shard.spec.layout``);
- the pure decode cores (``shard.decode``) import nothing from nodes, coordinator, failover,
  formation, membership, stage, transport, the CLI or the offline draft training
  (``shard.training``);
- ``shard.compute`` (offload, wire tensors) sits below every role: it imports only
  ``shard.messages``;
- the HTTP API (``shard.api``) serves the coordinator: it imports neither the composition
  roots (``shard.nodes``) nor the CLI, and no torch;
- ``shard.placement`` is pure planning: it imports no other shard package but
  ``shard.errors``, and nothing of torch or the network;
- ``shard.membership`` (the registry of members and slots, RTT tracking) is what formation and
  recovery share: it imports neither ``shard.formation`` nor ``shard.failover``;
- ``shard.formation`` (forming a ring over a measured RTT mesh) sits below recovery: it never
  imports ``shard.failover``, whose scheduler drives it;
- no package imports itself through others: the packages form layers, with no exception;
- the runtime (``RUNTIME``: a running node's packages) never imports GGUF conversion
  (``shard.convert``); only the CLI, the composition roots, the draft training and
  ``shard.cli.benchmark`` find and convert models through it;
- nothing in ``src`` imports the test helpers (``shard.testing``: tiny checkpoints, cheating
  stages, the NAT firewall and tampering relay, fault injection, the monitor's fixed
  snapshots, the entry points of cheating processes), except those helpers themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

import attrs

SRC = Path(__file__).resolve().parents[1] / "src" / "shard"
NETWORK = ("trio", "trio_websocket", "msgpack", "zstandard", "nacl", "websockets")
#: The packages a running node's path goes through: none of them imports ``shard.convert``.
RUNTIME = (
    "model",
    "stage",
    "decode",
    "coordinator",
    "compute",
    "wire",
    "messages",
    "transport",
    "failover",
    "formation",
    "membership",
    "placement",
    "audit",
    "trust",
    "weights",
    "api",
    "observe",
    "spec",
)


@attrs.frozen
class Rule:
    """Modules under ``layer`` must not import anything starting with one of ``forbidden``."""

    layer: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()  # exceptions to ``forbidden`` (prefixes)


RULES = (
    # shard.strict_json (no imports of its own) is the one strict JSON parser, as shard.errors
    # is the one shared error: model files are parsed by it too.
    Rule("shard.model", ("shard.", *NETWORK), allowed=("shard.model", "shard.strict_json")),
    Rule("shard.wire", ("shard.",), allowed=("shard.wire", "shard.messages", "shard.errors")),
    Rule("shard.messages", ("shard.",), allowed=("shard.messages",)),
    # A spec names public keys: it parses them with the identity module (pure crypto). Its
    # [speculation] K/D policy is the controller's own record (shard.decode.control: pure),
    # and a shipped draft head's name is resolved by shard.decode.head.shipped (pure: paths);
    # its ring is planned by shard.placement (pure: shard.spec.layout).
    Rule(
        "shard.spec",
        ("shard.", "torch", "trio", "trio_websocket", "msgpack", "zstandard"),
        allowed=(
            "shard.spec",
            "shard.messages",
            "shard.trust.identity",
            "shard.decode.control",
            "shard.decode.head.shipped",
            "shard.placement",
        ),
    ),
    Rule(
        "shard.decode",
        (
            "shard.nodes",
            "shard.coordinator",
            "shard.failover",
            "shard.formation",
            "shard.membership",
            "shard.stage",
            "shard.transport",
            "shard.cli",
            "shard.training",
            *NETWORK[1:],
        ),
    ),
    Rule("shard.compute", ("shard.",), allowed=("shard.compute", "shard.messages")),
    Rule("shard.api", ("shard.nodes", "shard.cli", "torch")),
    Rule(
        "shard.placement",
        ("shard.", "torch", "numpy", *NETWORK),
        allowed=("shard.placement", "shard.errors"),
    ),
    # Formation and recovery share the registry and RTT tracking; neither sits below it.
    Rule("shard.membership", ("shard.formation", "shard.failover")),
    # The scheduler (recovery) drives the formation, never the other way round.
    Rule("shard.formation", ("shard.failover",)),
    Rule("shard", ("shard.testing",), allowed=()),
    # GGUF conversion sits beside the runtime: only the CLI, the composition roots, the draft
    # training and the benchmark find and convert models through it.
    *(Rule(f"shard.{p}", ("shard.convert",)) for p in RUNTIME),
)
#: Test support may import itself.
TEST_SUPPORT = ("shard.testing",)


def module_name(root: Path, path: Path) -> str:
    """``root/a/b.py`` -> ``shard.a.b``; a package's ``__init__`` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("shard", *parts))


def imports_of(path: Path, name: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports, with its line: ``import a.b`` as ``a.b``, ``from a import b``
    as ``a.b`` (``b`` may be a module or a name in ``a``), relative imports resolved against
    ``name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _matches(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(
        target == p.rstrip(".")
        or target.startswith(p.rstrip(".") + ".")
        or (p.endswith(".") and target.startswith(p))
        for p in prefixes
    )


def violations(root: Path) -> list[str]:
    """``FILE:LINE: MODULE imports TARGET (rule LAYER)`` for every broken rule under ``root``."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(root, path)
        for rule in RULES:
            if not _matches(name, (rule.layer,)):
                continue
            if rule.layer == "shard" and _matches(name, TEST_SUPPORT):
                continue
            for line, target in imports_of(path, name):
                if _matches(target, rule.forbidden) and not _matches(target, rule.allowed):
                    out.append(f"{path}:{line}: {name} imports {target} (rule {rule.layer})")
    return out


def test_source_tree_keeps_its_import_boundaries() -> None:
    """No module in src/shard imports across a forbidden boundary."""
    found = violations(SRC)
    assert found == [], "\n".join(found)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "shard"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_a_forbidden_import_is_reported(tmp_path: Path) -> None:
    """Each rule catches a module that breaks it, plain, relative and function-local."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "model/__init__.py": "",
            "model/llama.py": "import trio\nfrom shard.messages import Tensor\n",
            "wire/__init__.py": "",
            "wire/frame.py": "def f():\n    from shard.nodes import stage\n",
            "decode/__init__.py": "",
            "decode/draft.py": "from ..coordinator import router\n",
            "nodes/__init__.py": "",
            "nodes/stage.py": "from shard.testing import make_tiny_checkpoint\n",
            "placement/__init__.py": "",
            "placement/search.py": "import trio\nfrom shard.spec.swarm import SwarmSpec\n",
            "testing/__init__.py": "",
            "testing/cheats.py": "from shard.testing import faults\n",
            "membership/__init__.py": "",
            "membership/registry.py": "from shard.formation.mesh import Mesh\n",
            "formation/__init__.py": "",
            "formation/formation.py": "def f():\n    from shard.failover import scheduler\n",
            "stage/__init__.py": "",
            "stage/executor.py": "from shard.convert.bundled import resolve_model\n",
        },
    )
    found = "\n".join(violations(root))
    assert "shard.model.llama imports trio" in found
    assert "shard.model.llama imports shard.messages" in found
    assert "shard.wire.frame imports shard.nodes" in found
    assert "shard.decode.draft imports shard.coordinator" in found
    assert "shard.nodes.stage imports shard.testing" in found
    assert "shard.placement.search imports trio" in found
    assert "shard.placement.search imports shard.spec" in found
    assert "shard.membership.registry imports shard.formation" in found
    assert "shard.formation.formation imports shard.failover" in found
    assert "shard.stage.executor imports shard.convert" in found
    assert "shard.testing imports" not in found  # test support may use fault injection


def test_allowed_imports_are_not_reported(tmp_path: Path) -> None:
    """Imports inside the rules give no violation (the checker is not merely noisy)."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "model/__init__.py": "",
            "model/llama.py": "import torch\nfrom shard.model.config import ModelConfig\n",
            "wire/__init__.py": "",
            "wire/frame.py": "from shard.messages import Message\nfrom . import limits\n",
            "decode/__init__.py": "",
            "decode/draft.py": "from shard.model.llama import StageModel\n",
            "placement/__init__.py": "",
            "placement/lap.py": "from shard.placement.problem import Problem\nimport attrs\n",
        },
    )
    assert violations(root) == []


def package_graph(root: Path) -> dict[str, dict[str, list[str]]]:
    """``{package: {imported package: [FILE:LINE, ...]}}`` between the packages directly under
    ``root`` (a module's package is its first component: ``shard.a.b.c`` is in ``a``; the root's
    own modules are outside every package)."""
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in packages}
    for path in sorted(root.rglob("*.py")):
        name = module_name(root, path)
        source = name.split(".")[1] if name.count(".") else ""
        if source not in packages:
            continue
        for line, target in imports_of(path, name):
            parts = target.split(".")
            if parts[0] != "shard" or len(parts) < 2 or parts[1] not in packages:
                continue
            if parts[1] != source:
                graph[source].setdefault(parts[1], []).append(f"{path.name}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Every strongly connected set of more than one package (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_package_imports_itself_through_others() -> None:
    """The packages form layers: no cycle among them, with no exception listed."""
    graph = package_graph(SRC)
    found = cycles(graph)
    detail = [
        f"{a} -> {b}: {', '.join(graph[a][b][:3])}"
        for members in found
        for a in members
        for b in members
        if b in graph[a]
    ]
    assert found == [], "\n".join(detail)


def test_a_package_cycle_is_reported(tmp_path: Path) -> None:
    """Two packages importing each other (one function-locally) are found as one cycle."""
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/x.py": "from shard.b.y import f\n",
            "b/__init__.py": "",
            "b/y.py": "def f():\n    from shard.a import x\n",
            "c/__init__.py": "",
            "c/z.py": "from shard.a.x import f\n",
        },
    )
    assert cycles(package_graph(root)) == [["a", "b"]]
