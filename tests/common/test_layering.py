"""The layering of ARCHITECTURE.md holds: data flows one way (public function → ops →
kernel), nothing imports in a cycle, and the fast path never loads the reference."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import types

import rlvr_kernels

PACKAGE = pathlib.Path(rlvr_kernels.__file__).resolve().parent


def _top_level(nodes):
    """Import statements that run when the module is imported (not those inside functions)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            yield from _top_level(node.body + node.orelse + getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def _imports(path: pathlib.Path, top_level: bool):
    """The rlvr_kernels names a file imports (absolute names): at import time only, or
    anywhere in the file."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        module = module.rsplit(".", 1)[0] if module.endswith(".__init__") else module
        package = module
    out = set()
    tree = ast.parse(path.read_text())
    nodes = (
        _top_level(tree.body)
        if top_level
        else (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
    )
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("rlvr_kernels"):
                out.add(name)
                out.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlvr_kernels"))
    return module, out - {module.removesuffix(".__init__")}


def _graph(top_level: bool):
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module, deps = _imports(path, top_level)
        graph[module.removesuffix(".__init__")] = deps
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_layer_imports_upwards():
    """triton/ and reference/ never import ops/; bench/ never imports the CLI (at import
    time or inside a function: the whole file is searched)."""
    forbidden = {"triton": ("ops",), "reference": ("ops", "triton"), "bench": ("cli",), "contracts": ("ops", "triton")}
    bad = []
    for module, deps in _graph(top_level=False).items():
        for dep in deps:
            if _layer(dep) in forbidden.get(_layer(module), ()):
                bad.append(f"{module} imports {dep}")
    assert not bad, bad


def test_no_import_cycles_between_modules():
    graph = _graph(top_level=True)
    graph = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m) :] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in graph.get(m, ()):
            if d != "rlvr_kernels":  # the package's __init__ re-exports; submodules may import names from it
                visit(d)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    assert not cycles, cycles


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
