"""The package's import structure: light faces, and no import cycles between modules."""

import subprocess
import sys

import pytest


def _loaded(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; it prints whether torch and Pyro were loaded."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_algorithms_load_neither_torch_nor_pyro():
    code = (
        "import bayesfuse.inference, bayesfuse.inference.matching, bayesfuse.inference.layerwise, "
        "bayesfuse.inference.klfusion, bayesfuse.inference.spec, bayesfuse.inference.fedma, "
        "bayesfuse.inference.relaxed, bayesfuse.inference.otfusion, bayesfuse.inference.empirical_bayes, "
        "bayesfuse.inference.result, sys; print('torch' in sys.modules, 'pyro' in sys.modules)"
    )
    assert _loaded(code) == ["False", "False"]


def test_every_algorithm_module_loads_neither_torch_nor_pyro():
    # every module under bayesfuse.inference, found by walking the package (new ones included)
    code = (
        "import pkgutil, importlib, sys, bayesfuse.inference as p; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(p.__path__, 'bayesfuse.inference.')]; "
        "print('torch' in sys.modules, 'pyro' in sys.modules)"
    )
    assert _loaded(code) == ["False", "False"]


def test_importing_the_package_loads_no_torch():
    assert _loaded("import bayesfuse, sys; print('torch' in sys.modules)") == ["False"]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def test_strongly_connected_components_of_a_small_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(_strongly_connected(graph)) == [["a", "b", "c"], ["d"], ["e"]]


def test_no_import_cycles_between_modules():
    """Every import counts, those inside functions too: a cycle is a cycle whenever it closes."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")
    graph = grimp.build_graph("bayesfuse")
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = [c for c in _strongly_connected(edges) if len(c) > 1]
    chains = []
    for members in cycles:
        chain = graph.find_shortest_chain(members[0], members[1]) or ()
        back = graph.find_shortest_chain(members[1], members[0]) or ()
        chains.append(f"{members}: {' -> '.join(chain)} and back {' -> '.join(back)}")
    assert not cycles, "import cycles:\n" + "\n".join(chains)


def test_to_arviz_conveniences_reach_analysis_without_the_algorithms_importing_it():
    # the algorithms load no analysis; the first to_arviz() loads it, and it registered its exporters
    code = (
        "import sys, numpy as np; from bayesfuse.inference.matching import match_neurons; "
        "from bayesfuse.inference.klfusion import kl_fuse; from bayesfuse.inference.expfam import DiagNormal; "
        "rng = np.random.default_rng(0); r = match_neurons([rng.normal(size=(3, 4)) for _ in range(2)]); "
        "print('bayesfuse.analysis' in sys.modules); m = r.to_arviz(); print('bayesfuse.analysis' in sys.modules); "
        "k = kl_fuse([DiagNormal(loc=rng.normal(size=(2, 3)), var=np.ones((2, 3))) for _ in range(2)]).to_arviz(); "
        "print(m.posterior.attrs['method'], k.posterior.attrs['method'])"
    )
    assert _loaded(code) == ["False", "True", "pfnm", "kl"]
