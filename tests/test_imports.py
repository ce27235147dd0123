"""The project's import graph, read from the source with ``ast`` (nothing is imported): no module
imports itself round a cycle, and the libraries stay below the recipe (``loss`` <- ``megatron_bridge``
<- ``recipe``: a layer imports nothing from the layers above it).

Every import statement counts wherever it stands: at module level, inside a function, under ``if
TYPE_CHECKING:`` or in a ``try`` (a lazy or type-only import still makes the module depend on the
other: the cycle is in the design even where Python never trips on it). Each resolves to project
modules (a package is its ``__init__``):

- ``import a.b.c`` and ``from a.b.c import name`` import ``a.b.c``; ``from a.b import c`` imports
  ``a.b.c`` when ``c`` is a submodule, else ``a.b`` (``c`` is a name defined there). Relative
  forms (``from . import x``, ``from ..a import y``) resolve against the importing module's
  package first.
- Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, so it imports those too,
  except the packages that contain the importing module: Python initialises a module's own
  packages before the module, so that implied edge is always met and would only make every
  package that imports one of its submodules in its ``__init__`` look cyclic. An explicit
  ``from a import name`` in ``a.x`` still counts: it reads ``a``'s ``__init__``, which may be
  the one importing ``a.x``.

Modules outside ``loss``, ``megatron_bridge`` and ``recipe`` (the standard library, torch,
``tests``, ``bench``) are not part of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("loss", "megatron_bridge", "recipe")  # lowest layer first


def module_files(root: Path) -> dict[str, Path]:
    """Every project module's dotted name -> its file."""
    files = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules one import statement in ``module`` names (before the implied parents)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    found = set()
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in modules:
            found.add(submodule)
        elif source in modules:
            found.add(source)
    return found


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Each project module under ``root`` -> the project modules it imports (module docstring)."""
    files = module_files(root)
    modules = set(files)
    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        own_packages = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, module, is_package, modules):
                    edges.add(target)
                    parents = {target.rsplit(".", i)[0] for i in range(1, target.count(".") + 1)}
                    edges |= (parents & modules) - own_packages
        graph[module] = edges - {module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search closes, each as its chain of modules (the first again at the
    end): at least one through every group of modules that import each other round."""
    cycles, done, path = [], set(), []

    def visit(module: str) -> None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target)
        done.add(path.pop())

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def test_the_graph_follows_the_rules(tmp_path):
    sources = {
        "recipe/__init__.py": "",
        "recipe/job/__init__.py": "from . import steps\n",  # its own submodule: no cycle
        "recipe/job/steps.py": "from recipe.job.names import STEP\nfrom recipe.tools import log\n",
        "recipe/job/names.py": "STEP = 1\n",
        "recipe/tools/__init__.py": "",
        "recipe/tools/log.py": "def log():\n    from ..job import names  # lazy, relative\n",
        "recipe/tools/cli.py": "import recipe.job.steps\nfrom recipe.tools import log as _\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["recipe.job"] == {"recipe.job.steps"}
    assert graph["recipe.job.steps"] == {"recipe.job.names", "recipe.tools.log", "recipe.tools"}
    assert graph["recipe.tools.log"] == {"recipe.job.names", "recipe.job"}
    assert graph["recipe.tools.cli"] == {"recipe.job.steps", "recipe.job", "recipe.tools.log"}
    assert find_cycles(graph) == [["recipe.job", "recipe.job.steps", "recipe.tools.log", "recipe.job"]]


@pytest.fixture(scope="module")
def repo_graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_cycle(repo_graph):
    cycles = find_cycles(repo_graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_layers_import_nothing_from_above(repo_graph):
    upward = [f"{module} imports {target}" for module, targets in sorted(repo_graph.items()) for target in sorted(targets)
              if PACKAGES.index(target.split(".")[0]) > PACKAGES.index(module.split(".")[0])]
    assert not upward, "a lower layer imports a higher one (loss <- megatron_bridge <- recipe):\n" + "\n".join(upward)
