"""No import circles in ``gdn_jax``: the import graph, read from the source with ``ast``, has no cycle.

Every import statement counts, wherever it stands: at module level, inside a function (a "lazy"
import hides a circle from ``import gdn_jax`` but not from this test), a class or an ``if``. An edge
goes from the importing module to

* the module imported (``import a.b.c``: ``a.b.c``; ``from a.b import c``: ``a.b.c`` where that is a
  module, else ``a.b``), relative imports resolved against the importer's package;
* every package above it that is not also above the importer (importing ``gdn_jax.ops.pallas.config``
  from ``gdn_jax.ops.backends`` runs ``gdn_jax/ops/pallas/__init__.py`` first); the importer's own
  packages (``from . import x``, ``from .. import y``) give no edge: they are being imported already.

Names outside ``gdn_jax`` are ignored. ``test_cycle_finder_finds_cycles`` checks the finder itself on
a small package written for it.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set

import gdn_jax


def module_names(root: pathlib.Path) -> Dict[str, bool]:
    """``{dotted module name: is a package}`` for every ``.py`` file under package ``root``."""
    out = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = is_pkg
    return out


def _ancestors(name: str) -> List[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _known(name: str, modules) -> Optional[str]:
    """The longest prefix of ``name`` that is one of ``modules`` (None: not in the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: pathlib.Path) -> Dict[str, Set[str]]:
    """``{module: modules it imports}`` for package ``root`` (see the module docstring)."""
    modules = module_names(root)
    graph = {}
    for name, is_pkg in modules.items():
        path = root.parent.joinpath(*name.split("."))
        path = path / "__init__.py" if is_pkg else path.with_suffix(".py")
        package = name if is_pkg else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_known(a.name, modules) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                targets.add(_known(src, modules))
                targets.update(f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in modules)
        edges = set()
        own = set(_ancestors(name))
        for t in targets - {None, name} - own:  # the importer's own packages are being imported already
            edges.add(t)
            edges.update(p for p in _ancestors(t) if p not in own and p != name)
        graph[name] = edges
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of ``graph`` as ``[m0, m1, ..., m0]``, or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_gdn_jax_has_no_import_cycle():
    root = pathlib.Path(gdn_jax.__file__).parent
    graph = import_graph(root)
    assert len(graph) > 40 and "gdn_jax.ops.pallas.config" in graph  # the whole package was read
    assert "gdn_jax.ops.backends" in graph["gdn_jax.ops.gated_delta_rule"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _write(root: pathlib.Path, files: Dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root / "pkg"


def test_cycle_finder_finds_cycles(tmp_path):
    """The finder sees a circle closed by an import inside a function, by a relative import two levels
    up, by ``from package import submodule`` and through a package's ``__init__``; and no circle
    where there is none."""
    base = {"pkg/__init__.py": "", "pkg/sub/__init__.py": "", "pkg/c.py": "X = 1\n"}
    # a -> sub.b at module level, sub.b -> a inside a function (two levels up)
    lazy = _write(tmp_path / "lazy", {**base, "pkg/a.py": "from .sub import b\n",
                                      "pkg/sub/b.py": "def f():\n    from .. import a\n    return a\n"})
    assert find_cycle(import_graph(lazy)) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    # m imports sub.b, which makes sub/__init__ run; sub/__init__ imports m (absolute, in a method)
    init = _write(tmp_path / "init", {**base, "pkg/m.py": "import pkg.sub.b\n", "pkg/sub/b.py": "",
                                      "pkg/sub/__init__.py": "class A:\n    def f(self):\n        from pkg import m\n"})
    cycle = find_cycle(import_graph(init))
    assert cycle is not None and set(cycle) == {"pkg.m", "pkg.sub"}
    # no cycle: a chain, a module importing its own package, and a name from a package
    ok = _write(tmp_path / "ok", {**base, "pkg/a.py": "from . import c\nfrom .c import X\n",
                                  "pkg/sub/b.py": "from .. import a\nfrom pkg import c\n",
                                  "pkg/sub/__init__.py": "from . import b\n"})
    graph = import_graph(ok)
    assert graph["pkg.sub.b"] == {"pkg.a", "pkg.c"} and graph["pkg.a"] == {"pkg.c"}
    assert find_cycle(graph) is None


def test_backend_rules_have_one_home():
    """The op, the layers and LMConfig check backends through ``gdn_jax.ops.backends``, and the rules'
    own statements (the backend names, who takes a kernel_config, the auto policy) appear only there."""
    root = pathlib.Path(gdn_jax.__file__).parent
    graph = import_graph(root)
    for user in ("gdn_jax.ops.gated_delta_rule", "gdn_jax.layers.gated_deltanet", "gdn_jax.layers.kda",
                 "gdn_jax.models.lm"):
        assert "gdn_jax.ops.backends" in graph[user], user
    for marker in ('BACKENDS = ("auto", "scan", "chunk", "pallas")', "kernel_config configures the Pallas kernels",
                   "AUTO_F32_MIN_DIM <= max(K, V)"):
        homes = sorted(str(f.relative_to(root)) for f in root.rglob("*.py") if marker in f.read_text())
        assert homes == ["ops/backends.py"], (marker, homes)
