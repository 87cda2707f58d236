"""The package is built in floors: a module imports only its own layer or a lower floor, the
import graph has no cycle, and a private module (a name with a leading underscore) is
imported only from its own layer, except the ground floor ``_core``, which every layer uses.

The floors, lowest first (a layer is the first name under ``rlvr_kernels``; layers on one
floor are independent of each other):

 0. ``_core`` (validation, dispatch table, CPU cache, packed-layout rules, collectives,
    platform, the roundings of the logits precisions, the build of the C++ kernels);
 1. ``contracts`` (kernel parameter lists and branch codes), ``options`` (option
    dataclasses and presets);
 2. ``reference`` (the spec, pure torch);
 3. ``triton`` (the CUDA kernels and their launchers);
 4. ``ops`` (validation, custom ops and autograd of each op family);
 5. ``packing`` (prefix-tree packing, row plans, group balancing), ``dynamics``,
    ``async_rollout``;
 6. ``distributed`` (global counts, rank balancing);
 7. the package itself (``rlvr_kernels/__init__.py``: the public functions);
 8. ``integrations`` (TRL and verl drop-ins and patches);
 9. ``testing`` (the correctness harness of the tests and of ``rlvr-kernels check``);
10. ``bench`` (the benchmarks);
11. ``cli`` and ``__main__``.

The graph is built with ``ast`` from every import statement of every file (at module level
and inside functions; relative and absolute): ``from X import a`` is an edge to the module
``X.a`` when there is one, else to ``X``. The providers of the dispatch table
(``_core/dispatch.py``) are strings resolved when a kernel first runs, not imports.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import types
from typing import Dict, List, Optional, Set

import rlvr_kernels

PACKAGE = pathlib.Path(rlvr_kernels.__file__).resolve().parent
ROOT = "rlvr_kernels"

FLOORS = (
    ("_core",),
    ("contracts", "options"),
    ("reference",),
    ("triton",),
    ("ops",),
    ("packing", "dynamics", "async_rollout"),
    ("distributed",),
    ("",),
    ("integrations",),
    ("testing",),
    ("bench",),
    ("cli",),
)
# Top-level modules that belong to another layer:
# ``python -m rlvr_kernels`` to the CLI.
MEMBERS = {"__main__": "cli"}
FLOOR = {layer: i for i, layers in enumerate(FLOORS) for layer in layers}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str, path: pathlib.Path, known: Set[str]) -> Set[str]:
    """The package's modules (or the package itself) that ``module`` imports anywhere."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == ROOT)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != ROOT:
                continue
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                out.add(sub if sub in known else name)
    out.discard(module)
    return out


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return MEMBERS.get(parts[1], parts[1]) if len(parts) > 1 else ""


def _is_private(module: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in module.split(".")[1:])


def _find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of ``graph`` as [m0, m1, ..., m0], or None (iterative depth-first search)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt) and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_every_module_has_a_floor():
    layers = {_layer(m) for m in _graph()}
    assert layers <= set(FLOOR), f"modules outside every floor (add their layer to FLOORS): {layers - set(FLOOR)}"


def test_every_import_resolves_to_a_module():
    graph = _graph()
    known = set(graph)
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps if d not in known)
    assert not bad, bad


def test_no_import_cycles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_higher_floor_or_a_sibling_layer():
    bad = []
    for module, deps in sorted(_graph().items()):
        here = _layer(module)
        for dep in sorted(deps):
            there = _layer(dep)
            if here not in FLOOR or there not in FLOOR:
                bad.append(f"{module} imports {dep}: a layer without a floor")
            elif there != here and FLOOR[there] >= FLOOR[here]:
                bad.append(f"{module} (floor {FLOOR[here]}) imports {dep} (floor {FLOOR[there]})")
    assert not bad, bad


def test_private_modules_stay_inside_their_layer():
    """``_core`` is the one private layer every other may import."""
    bad = []
    for module, deps in sorted(_graph().items()):
        for dep in sorted(deps):
            if _is_private(dep) and _layer(dep) not in (_layer(module), "_core"):
                bad.append(f"{module} imports {dep}")
    assert not bad, bad


def test_collectives_run_only_through_core():
    """Every ``process_group=`` path of the ops and ``rlvr_kernels.distributed`` uses
    ``_core.collectives`` (one handshake, one set of collectives): no other module of
    those floors imports ``torch.distributed``."""
    bad = set()
    for module, path in _modules().items():
        if _layer(module) not in ("ops", "distributed", "reference", "triton", "contracts"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                bad.add(module)
    assert not bad, sorted(bad)


def test_the_graph_sees_both_kinds_of_import():
    """The checks above read function-level and relative imports too (a regression guard
    for the graph builder itself)."""
    graph = _graph()
    assert f"{ROOT}.ops.advantages" in graph[ROOT]  # module level, relative
    assert f"{ROOT}.testing.verl_engine" in graph[f"{ROOT}.bench.verl_step"]  # inside a function
    assert f"{ROOT}._core.extension" in graph[f"{ROOT}._core.dispatch"]  # inside a function, relative
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_ops_modules_are_not_shadowed():
    import rlvr_kernels.ops as ops

    for name in ("advantages", "policy_loss", "logprobs"):
        __import__(f"rlvr_kernels.ops.{name}")
        assert isinstance(getattr(ops, name), types.ModuleType), name


def test_fast_path_does_not_load_the_reference():
    code = (
        "import sys, torch, rlvr_kernels as rk\n"
        "rk.group_advantages(torch.randn(8), group_size=4)\n"
        "lp = torch.randn(2, 5, requires_grad=True)\n"
        "loss, _ = rk.policy_loss(lp, lp.detach(), torch.randn(2), torch.ones(2, 5, dtype=torch.bool))\n"
        "loss.backward()\n"
        "rk.linear_logprobs(torch.randn(3, 4), torch.randn(7, 4), torch.tensor([1, 2, 3]))\n"
        "rk.logprobs_from_logits(torch.randn(3, 7), torch.tensor([1, 2, 3]))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('rlvr_kernels.reference'))\n"
        "assert not loaded, loaded\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
