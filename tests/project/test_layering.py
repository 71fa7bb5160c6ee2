"""Imports inside ``hf_grpo`` run one way (docs/concepts.md, "Imports run downward").

The graph is read from the source with ``ast``, every import statement counted, those inside functions too: a
function-level import is still a tie, it only hides a cycle until the function runs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_grpo"
FEATURES = ("hf_grpo.diffusion", "hf_grpo.training", "hf_grpo.memory", "hf_grpo.generation")
ABOVE_FEATURES = ("hf_grpo.recipe_support", "hf_grpo.cli")
BATCH_ARITHMETIC = ("hf_grpo.batch_fields", "hf_grpo.plan")


def module_files(package: pathlib.Path = PACKAGE) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {module of ``hf_grpo`` it imports: line of the first such import}.

    ``from a import b`` is an import of ``a.b`` where that is a module, else of ``a``; relative imports are
    resolved against the importing module's package.
    """
    modules = module_files(package)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names if alias.name.split(".")[0] == "hf_grpo"]
            elif isinstance(node, ast.ImportFrom):
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                if source.split(".")[0] == "hf_grpo":
                    targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else known(source)
                               for a in node.names]
            for target in targets:
                if target is not None and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def where(graph, importer: str, imported: str) -> str:
    path, _ = module_files()[importer]
    return f"{path.relative_to(ROOT)}:{graph[importer][imported]} imports {imported}"


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (a depth-first search; grey = on the current path)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "grey"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "black"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_relative_and_function_level_imports(graph):
    """The checks below read this graph: it must hold the imports that a regex or a top-level-only scan misses."""
    launch = graph["hf_grpo.recipe_support.diffusion_launch"]
    assert "hf_grpo.diffusion.config" in launch  # from ..diffusion.config import DiffuGRPOConfig (top level)
    assert "hf_grpo.diffusion.trainer" in launch  # from ..diffusion.trainer import ... (inside run_diffu_recipe)
    assert "hf_grpo.checks.output_lock" in graph["hf_grpo.recipe_support.launch"]  # from ..checks import output_lock
    assert "hf_grpo.diffusion.dream_sampler" in graph["hf_grpo.diffusion.sampler"]  # from . import dream_sampler
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 1}}) is None


def test_feature_packages_do_not_import_recipes_or_the_command_line(graph):
    """diffusion/, training/, memory/ and generation/ are features; recipe_support/ and cli/ sit above them."""
    upward = [where(graph, importer, imported) for importer, edges in graph.items() if under(importer, FEATURES)
              for imported in edges if under(imported, ABOVE_FEATURES)]
    assert not upward, "a feature package imports recipe or command-line code:\n" + "\n".join(upward)


def test_batch_arithmetic_imports_nothing_of_memory(graph):
    """batch_fields.py and plan.py are the batch contract's arithmetic (no torch at import); memory/ probes and
    backs off on the device, and imports them, not the other way round. Checked through every import they reach."""
    reached, todo = {}, [(name, name) for name in BATCH_ARITHMETIC]
    while todo:
        importer, origin = todo.pop()
        for imported in graph[importer]:
            if imported not in reached:
                reached[imported] = (importer, origin)
                todo.append((imported, origin))
    tied = [f"{origin} reaches {name} ({where(graph, importer, name)})"
            for name, (importer, origin) in reached.items() if under(name, ("hf_grpo.memory",))]
    assert not tied, "\n".join(tied)


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(
        where(graph, a, b) for a, b in zip(cycle, cycle[1:]))


RUNTIME = ("hf_grpo.runtime",)
# (importer, imported) packages that must not be tied: what both need lives lower, in runtime/
FORBIDDEN = [(("hf_grpo.distributed",), ("hf_grpo.checks",)),  # the lock's release: runtime.exit_hooks
             (("hf_grpo.memory", "hf_grpo.training"), ("hf_grpo.generation",))]  # collectives, capture, compile


def test_runtime_is_a_floor_that_imports_no_other_part_of_the_package(graph):
    """runtime/ (collectives, graph capture, regional compile, exit hooks, upstream's private names) is imported by
    the feature packages and imports none of them: only itself."""
    assert {name for name in graph if under(name, RUNTIME)} >= {
        "hf_grpo.runtime.collectives", "hf_grpo.runtime.exit_hooks", "hf_grpo.runtime.graph_capture",
        "hf_grpo.runtime.regional_compile", "hf_grpo.runtime.upstream"}
    upward = [where(graph, importer, imported) for importer, edges in graph.items() if under(importer, RUNTIME)
              for imported in edges if not under(imported, RUNTIME)]
    assert not upward, "runtime/ imports a package above it:\n" + "\n".join(upward)


@pytest.mark.parametrize("importers,imported", FORBIDDEN, ids=lambda p: "+".join(n.split(".")[-1] for n in p))
def test_packages_that_share_a_primitive_reach_it_through_runtime(graph, importers, imported):
    tied = [where(graph, a, b) for a, edges in graph.items() if under(a, importers)
            for b in edges if under(b, imported)]
    assert not tied, "\n".join(tied)
