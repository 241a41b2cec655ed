"""The floors of ../ARCHITECTURE.md, checked: every import of kernelkit (module level and inside functions)
points down or sideways, no two modules import each other through any path, and an import hides inside a
function only to defer a heavy optional dependency.

Run as a script to print the counts (upward edges, circles, deferred imports) for a closing note:
    python tests/test_layering.py
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "kernelkit"

# Floors, ground first: a module may import its own floor or any floor below it. The longest prefix wins.
FLOORS = {
    "kernelkit._version": 0, "kernelkit._requirements": 0, "kernelkit.switches": 0,
    "kernelkit.hw": 1,
    "kernelkit.runtime": 2, "kernelkit.roofline": 2,
    "kernelkit.ops": 3,
    "kernelkit.patch": 4, "kernelkit.nn": 4,
    "kernelkit.testing": 5, "kernelkit.profile": 5, "kernelkit.ladder": 5,
    "kernelkit.commands": 6,
    "kernelkit": 7, "kernelkit.__main__": 7,  # the package root re-exports the public API; only scripts use it
}

# A kernelkit import may hide inside a function only where the module it pulls in loads a heavy optional
# dependency at import (transformers, matplotlib, Gluon, CuPy / cuda-python), or in `commands`, whose imports
# are deferred so that `kernelkit --help` answers without importing torch and Triton.
HEAVY_TARGETS = ("kernelkit.patch", "kernelkit.roofline.plot", "kernelkit.ladder.hgemm_gluon", "kernelkit.ladder.nvrtc",
                 "kernelkit.profile.examples", "kernelkit.ops.gemm.precise")
LAZY_IMPORTERS = ("kernelkit.commands", "kernelkit.__main__")

# Upward edges kept on purpose, each with its reason. Target: none.
ALLOWED_UP: dict[tuple[str, str], str] = {}


def floor_of(module: str) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        rank = FLOORS.get(".".join(parts[:i]))
        if rank is not None:
            return rank
    raise KeyError(module)


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    # `from . import x` / `from .ops import rms_norm` may name submodules: those are what it imports; the
    # package itself only for names that are not submodules.
    subs, names = [], False
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if (SRC / Path(*sub.split("."))).with_suffix(".py").exists() or (SRC / Path(*sub.split("."))).is_dir():
            subs.append(sub)
        else:
            names = True
    return ([base] if names else []) + subs


def collect():
    """(importer, imported, deferred, lineno) for every kernelkit -> kernelkit import, and every deferred
    import of anything as (importer, imported, lineno)."""
    edges, deferred = [], []
    for path in sorted((SRC / PKG).rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        top_level = {id(n) for n in tree.body}
        # imports under `if TYPE_CHECKING:` or try/except at module level still run at import: module level
        for n in tree.body:
            if isinstance(n, (ast.If, ast.Try)):
                top_level |= {id(c) for c in ast.walk(n)}
        type_only = {id(c) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                     for c in ast.walk(n)}  # never runs: annotations only
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = _resolve(module, path.name == "__init__.py", node)
            else:
                continue
            is_deferred = id(node) not in top_level
            for name in names:
                if name == PKG or name.startswith(PKG + "."):
                    edges.append((module, name, is_deferred, node.lineno))
                if is_deferred:
                    deferred.append((module, name, node.lineno))
    return edges, deferred


def upward(edges):
    out = []
    for src, dst, _d, line in edges:
        if floor_of(dst) > floor_of(src) and (src, dst) not in ALLOWED_UP and not dst.startswith(src + "."):
            out.append(f"{src}:{line} -> {dst}")
    return sorted(set(out))


def circles(edges):
    """Strongly connected components of more than one module in the module-level-and-deferred import graph
    (a package's __init__ importing its own submodules is not a circle with them)."""
    graph: dict[str, set[str]] = {}
    modules = {e[0] for e in edges}
    for src, dst, _d, _l in edges:
        # an import of a package or of a name from it reaches the module that defines it
        target = dst if dst in modules else None
        if target and target != src and not src.startswith(target + ".") and not target.startswith(src + "."):
            graph.setdefault(src, set()).add(target)
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def unjustified_deferred(edges):
    def ok(src, dst):
        return (any(dst == h or dst.startswith(h + ".") for h in HEAVY_TARGETS)
                or any(src == m or src.startswith(m + ".") for m in LAZY_IMPORTERS))
    return sorted({f"{src}:{line} -> {dst}" for src, dst, deferred, line in edges if deferred and not ok(src, dst)})


def test_every_module_has_a_floor():
    edges, _ = collect()
    missing = sorted({m for e in edges for m in e[:2] if _no_floor(m)})
    assert not missing, f"modules outside every floor of FLOORS: {missing}"


def _no_floor(module):
    try:
        floor_of(module)
        return False
    except KeyError:
        return True


def test_no_import_points_up_a_floor():
    edges, _ = collect()
    up = upward(edges)
    assert not up, "imports pointing up a floor (move the code down instead):\n" + "\n".join(up)


def test_no_import_circles():
    edges, _ = collect()
    found = circles(edges)
    assert not found, f"import circles: {found}"


def test_deferred_imports_only_for_heavy_dependencies():
    edges, _ = collect()
    bad = unjustified_deferred(edges)
    assert not bad, "imports hidden inside functions without a heavy dependency as the reason:\n" + "\n".join(bad)


def test_floor_checker_sees_an_upward_edge(tmp_path):
    """The checker itself: an ops -> profile edge, module-level or deferred, is reported."""
    edges = [("kernelkit.ops.rms_norm", "kernelkit.profile.trace", False, 3),
             ("kernelkit.runtime.launch", "kernelkit.ops.registry", True, 9)]
    assert len(upward(edges)) == 2
    assert circles([("kernelkit.ops.a", "kernelkit.ops.b", False, 1), ("kernelkit.ops.b", "kernelkit.ops.a", True, 1)])


if __name__ == "__main__":
    edges, deferred = collect()
    up = upward(edges)
    circ = circles(edges)
    bad = unjustified_deferred(edges)
    print(f"kernelkit imports: {len(edges)}; deferred (inside functions): {sum(e[2] for e in edges)}")
    print(f"upward edges: {len(up)}")
    print("\n".join("  " + u for u in up))
    print(f"circles: {len(circ)}")
    for c in circ:
        print("  " + " <-> ".join(c))
    print(f"all deferred imports (third-party included): {len(deferred)}")
    print(f"deferred kernelkit imports without a heavy dependency as the reason: {len(bad)}")
    print("\n".join("  " + b for b in bad))
