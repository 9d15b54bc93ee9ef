"""The layout of ``gdn_jax/ops/pallas/`` (docs/kernels.md "Package layout"): modules share only public
names, the Hopper planning module imports no kernel, and no module grows past ~700 lines unless it
holds one kernel."""
from __future__ import annotations

import ast
import pathlib

import gdn_jax

PALLAS = pathlib.Path(gdn_jax.__file__).parent / "ops" / "pallas"
# the modules that are one kernel each (a longer file is allowed there)
ONE_KERNEL = set()
MAX_LINES = 700


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            yield node


def test_no_private_names_cross_modules():
    """No ``from .x import _name`` between the kernel package's modules (shared helpers are public)."""
    bad = []
    for f in sorted(PALLAS.rglob("*.py")):
        for node in _imports(f):
            bad += [f"{f.relative_to(PALLAS)}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_hopper_plan_imports_no_kernel():
    """hopper/plan.py imports only the call record (and jax.numpy): config plans a call without a kernel."""
    mods = set()
    for node in _imports(PALLAS / "hopper" / "plan.py"):
        mods.add("." * node.level + (node.module or ""))
    assert mods <= {"..call"}, mods
    assert not [n for n in ast.walk(ast.parse((PALLAS / "hopper" / "__init__.py").read_text()))
                if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_module_sizes():
    """No module of ops/pallas above ~700 lines unless it is one kernel."""
    long = {str(f.relative_to(PALLAS)): n for f in PALLAS.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_LINES and f.name not in ONE_KERNEL}
    assert not long, long
