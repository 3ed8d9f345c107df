"""The imports inside ``kernels/`` run one way: no module imports, directly or through others, a module that
imports it back. Function-level (lazy) imports count too: a lazy import that closes a circle still ties a
backend to its dispatcher. ``from PKG import NAME`` is an edge to ``PKG.NAME`` when that is a module (a submodule
import), else to ``PKG``. Only imports of modules inside ``kernels/`` are edges.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kernels"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, f in mods.items():
        pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in mods:
                        deps.add(sub)
                    elif base in mods:
                        deps.add(base)
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_in_kernels():
    graph = import_graph()
    assert "zerodiff.ops.sparse_attention" in graph and len(graph) > 50  # the walk sees the package
    assert find_cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_circle():
    graph = import_graph()
    graph["zerodiff.ops.kv_cache"] = graph["zerodiff.ops.kv_cache"] | {"zerodiff.ops.sparse_attention"}
    cycles = find_cycles(graph)
    assert any({"zerodiff.ops.kv_cache", "zerodiff.ops.sparse_attention"} <= set(c) for c in cycles), cycles
