"""The imports inside ``kernels/`` run one way: no module imports, directly or through others, a module that
imports it back. Function-level (lazy) imports count too: a lazy import that closes a circle still ties a
backend to its dispatcher. ``from PKG import NAME`` is an edge to ``PKG.NAME`` when that is a module (a submodule
import), else to ``PKG``. Only imports of modules inside ``kernels/`` are edges.

Second rule: no backend of the attention package (``zerodiff.ops.attention.*``) imports its dispatcher
(``zerodiff.ops.attention``, the package ``__init__``), directly or through other modules: the dispatcher imports
the backends, never the reverse.

Third rule: the shipped path (``zerodiff.ops``, ``model``, ``integrations``, ``rollout``, ``training``) never
reaches ``zerodiff.experimental``, directly or through other modules.
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
    assert "zerodiff.ops.attention" in graph and len(graph) > 50  # the walk sees the package
    assert find_cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_circle():
    graph = import_graph()
    graph["zerodiff.ops.kv_cache"] = graph["zerodiff.ops.kv_cache"] | {"zerodiff.ops.attention"}
    cycles = find_cycles(graph)
    assert any({"zerodiff.ops.kv_cache", "zerodiff.ops.attention"} <= set(c) for c in cycles), cycles


ATTENTION = "zerodiff.ops.attention"


def _chain_to(graph: dict[str, set[str]], root: str, hit) -> list[str] | None:
    """One shortest import chain from ``root`` to the first module ``w`` (breadth first, imports in sorted order)
    with ``hit(w)``, or None."""
    parent = {root: None}
    queue = [root]
    while queue:
        nxt = []
        for v in queue:
            for w in sorted(graph.get(v, ())):
                if w in parent:
                    continue
                parent[w] = v
                if hit(w):
                    chain = [w]
                    while parent[chain[-1]] is not None:
                        chain.append(parent[chain[-1]])
                    return chain[::-1]
                nxt.append(w)
        queue = nxt
    return None


def _reaches(graph: dict[str, set[str]], root: str, target: str) -> list[str] | None:
    """One shortest import chain from ``root`` to ``target`` (breadth first), or None."""
    return _chain_to(graph, root, lambda w: w == target)


def backends_reaching_the_dispatcher(graph: dict[str, set[str]]) -> list[list[str]]:
    """For every module of the attention package other than its ``__init__`` that reaches the dispatcher, one
    import chain from it to the dispatcher."""
    chains = []
    for m in sorted(graph):
        if m.startswith(ATTENTION + "."):
            chain = _reaches(graph, m, ATTENTION)
            if chain is not None:
                chains.append(chain)
    return chains


def test_no_attention_backend_imports_the_dispatcher():
    graph = import_graph()
    backends = [m for m in graph if m.startswith(ATTENTION + ".")]
    assert {"zerodiff.ops.attention.flashmla_fp8", "zerodiff.ops.attention.checks"} <= set(backends), backends
    assert {m for m in graph[ATTENTION] if m.startswith(ATTENTION + ".")}, "the dispatcher imports its backends"
    assert backends_reaching_the_dispatcher(graph) == []


def test_the_dispatcher_check_finds_planted_imports():
    graph = import_graph()
    # a backend importing the dispatcher directly (``from . import sparse_mla_attention``)
    graph["zerodiff.ops.attention.triton_split"] = graph["zerodiff.ops.attention.triton_split"] | {ATTENTION}
    # and one through a module outside the package
    graph["zerodiff.ops.attention.checks"] = graph["zerodiff.ops.attention.checks"] | {"zerodiff.model.ops"}
    chains = backends_reaching_the_dispatcher(graph)
    assert ["zerodiff.ops.attention.triton_split", ATTENTION] in chains, chains
    assert any(c[0] == "zerodiff.ops.attention.checks" and "zerodiff.model.ops" in c and c[-1] == ATTENTION
               for c in chains), chains


# the shipped path: what rollout and training run, and what the vLLM / Megatron patches import
SHIPPED_PACKAGES = ("zerodiff.ops", "zerodiff.model", "zerodiff.integrations", "zerodiff.rollout", "zerodiff.training")
EXPERIMENTAL = "zerodiff.experimental"


def _within(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def experimental_reached(graph: dict[str, set[str]]) -> list[list[str]]:
    """For every shipped-path module that reaches ``zerodiff.experimental`` (directly or through other modules),
    one import chain from it to the experimental module (breadth first: a shortest chain)."""
    chains = []
    for root in sorted(m for m in graph if any(_within(m, p) for p in SHIPPED_PACKAGES)):
        chain = _chain_to(graph, root, lambda w: _within(w, EXPERIMENTAL))
        if chain is not None:
            chains.append(chain)
    return chains


def test_the_shipped_path_never_imports_experimental():
    graph = import_graph()
    assert "zerodiff.experimental.mhc_variants" in graph and "zerodiff.ops.mhc" in graph  # the walk sees both
    assert any(_within(m, EXPERIMENTAL) for m in graph["zerodiff.e2e_cli"])  # experiments may (--mhc-variant)
    assert experimental_reached(graph) == []


def test_the_experimental_check_finds_planted_imports():
    graph = import_graph()
    # a direct import from the shipped path
    graph["zerodiff.ops.kv_cache"] = graph["zerodiff.ops.kv_cache"] | {"zerodiff.experimental.topk_variants"}
    # and one through a module outside the shipped packages (the baselines the baseline model imports)
    graph["zerodiff.baselines.mhc"] = graph["zerodiff.baselines.mhc"] | {"zerodiff.experimental"}
    chains = experimental_reached(graph)
    assert ["zerodiff.ops.kv_cache", "zerodiff.experimental.topk_variants"] in chains, chains
    assert any(c[0].startswith("zerodiff.model") and "zerodiff.baselines.mhc" in c for c in chains), chains
