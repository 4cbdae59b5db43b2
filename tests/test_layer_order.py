"""The layer order, held: every import of a raypipe module by a raypipe module, read from the
source with ``ast`` (no module is run, so no Ray is needed), at module level, in function and
class bodies, in ``try`` blocks and under ``if TYPE_CHECKING:`` alike (an import made only for
annotations is still a dependency on the imported module), and every
``importlib.import_module("raypipe...")`` with a literal name. Two rules:

1. No import of a higher layer than the importer's (``LAYERS``, low to high).
2. No import cycle: neither between modules (the strongly connected components of the module
   import graph, within one layer too) nor between folders (a package's modules taken together,
   so that two folders never import each other, even where each import is downward on its own).

docs/architecture.md ("Layer order") states the same order.

The module graph: an edge from the importing module to each raypipe module an import statement
loads (``from pkg import name`` is the submodule ``pkg.name`` where one exists, else ``pkg``;
relative imports are resolved). A package is its ``__init__.py``: a package whose ``__init__``
imports its own submodules (to re-export them) has an edge to each, like any other import.
The parent packages that Python runs before a submodule are not edges: a module ``pkg.sub``
importing ``pkg.other`` does not depend on what ``pkg/__init__.py`` imports, and counting them
would make every re-exporting package a cycle with each module under it. A submodule that
imports a name *from* its package's ``__init__`` has an explicit edge to the package, which
closes a real cycle where that ``__init__`` imports the submodule, and fails.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "raypipe"

# From low to high. Each entry names a layer and the modules in it: a name covers that
# module or package and everything under it; the longest matching name decides. A module
# may import its own layer and any lower one. Where this differs from the order the
# issue proposed (core < errors, config, ... ; planning and observability beside the
# checkpoint manager), the reason is beside the entry.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("raypipe.errors",)),  # imports nothing; core's validation raises ConfigError
    ("core", ("raypipe.core",)),
    ("config", ("raypipe.config", "raypipe.units", "raypipe.filesystem")),
    ("models and data", ("raypipe.models", "raypipe.data")),
    ("Hugging Face interop", ("raypipe.models.hf",)),  # builds on models.llama, never the other way
    # test and benchmark aids that ship with the package (timed layers): torch and models only
    ("testing aids", ("raypipe.testing",)),
    # pure computations over the above, no Ray: the controller re-partitions with planning's
    # memory model and can export its state through observability's metrics
    ("planning and observability", ("raypipe.planning", "raypipe.observability")),
    # the failure and scaling policies: pure decisions over a frozen view (no Ray, no I/O), asked
    # by the controller; below every mechanism (storage, comm, stage, runtime, executor) so they stay pure
    ("control decisions", ("raypipe.control.view", "raypipe.control.policy", "raypipe.control.stragglers")),
    ("checkpoint storage", ("raypipe.checkpoint",)),  # store, parts, hf_export (reads files, writes HF shards)
    ("comm", ("raypipe.comm",)),
    ("stage", ("raypipe.stage",)),
    # the in-process interpreter of lowered ops runs stage workers (no Ray): a testing aid above the stage
    ("stage testing aids", ("raypipe.testing.op_interpreter", "raypipe.testing.memory_channel")),
    ("runtime", ("raypipe.runtime",)),
    ("executor", ("raypipe.executor",)),
    ("control", ("raypipe.control",)),
    ("checkpoint manager", ("raypipe.checkpoint_manager",)),  # when and what to save, the trainer's state
    ("entry points", ("raypipe.trainer", "raypipe.fit", "raypipe.run", "raypipe.cli")),
]
TOP = "raypipe"  # raypipe/__init__.py, the facade: in the top layer


def layer_of(module: str, is_package: bool = False) -> int:
    """The index in LAYERS of ``module`` (dotted name under raypipe): the longest listed name
    that covers it. A subpackage's __init__.py runs before any of its modules, so a package
    is in its lowest layer (``raypipe.control`` is in the control decisions' layer)."""
    if module == TOP:
        return len(LAYERS) - 1
    best, best_length = None, -1
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_length:
                best, best_length = index, len(name)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layer_order.py's LAYERS: add it")
    if is_package:
        inside = [index for index, (_, names) in enumerate(LAYERS) for name in names if name.startswith(module + ".")]
        best = min([best, *inside])
    return best


@dataclass(frozen=True, order=True)
class Import:
    """``module`` loads ``imported`` at ``line`` (both dotted raypipe module names)."""

    module: str
    line: int
    imported: str


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    module_layer: str
    imported_layer: str

    def __str__(self) -> str:
        return (f"{self.module} line {self.line} imports {self.imported}: "
                f"layer '{self.module_layer}' imports the higher layer '{self.imported_layer}'")


@dataclass(frozen=True)
class Cycle:
    """A strongly connected component of the import graph: ``members`` (modules or folders)
    each reach every other through ``imports``, the imports among them."""

    members: tuple[str, ...]
    imports: tuple[Import, ...]

    def __str__(self) -> str:
        return (f"import cycle among {', '.join(self.members)}: "
                + "; ".join(f"{i.module} line {i.line} imports {i.imported}" for i in self.imports))


def module_name(path: Path, root: Path) -> str:
    """``raypipe/checkpoint/store.py`` -> ``raypipe.checkpoint.store``; a package's __init__.py is the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom | ast.Call]:
    """Every import statement at any depth (``if TYPE_CHECKING:`` bodies included), and every
    ``import_module("...")`` / ``__import__("...")`` call with a literal module name."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            if name in ("import_module", "__import__"):
                yield node


def imported_modules(node: ast.Import | ast.ImportFrom | ast.Call, module: str, is_package: bool,
                     known: set[str]) -> list[str]:
    """The raypipe modules an import loads (relative imports resolved; ``from pkg import sub``
    names the submodule ``pkg.sub`` where one exists, else ``pkg``)."""
    if isinstance(node, ast.Call):
        names = [node.args[0].value]
    elif isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != "raypipe":
            return []
        found = []
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            found.append(submodule if submodule in known else source)
        return found
    return [name for name in names if name.split(".")[0] == "raypipe"]


def import_graph(root: Path = PACKAGE_ROOT) -> tuple[list[Import], set[str]]:
    """Every import of a raypipe module under ``root`` (the raypipe package folder), a module's
    imports of itself left out, and the set of packages (their ``__init__``)."""
    paths = sorted(root.rglob("*.py"))
    packages = {module_name(path, root) for path in paths if path.name == "__init__.py"}
    known = {module_name(path, root) for path in paths}
    found = set()
    for path in paths:
        module = module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _import_nodes(tree):
            for imported in imported_modules(node, module, module in packages, known):
                if imported != module:
                    found.add(Import(module, node.lineno, imported))
    return sorted(found), packages


def violations(root: Path = PACKAGE_ROOT) -> list[Violation]:
    """Every import under ``root`` of a layer above the importer's."""
    imports, packages = import_graph(root)
    found = set()
    for i in imports:
        own, other = layer_of(i.module, i.module in packages), layer_of(i.imported, i.imported in packages)
        if other > own:
            found.add(Violation(i.module, i.line, i.imported, LAYERS[own][0], LAYERS[other][0]))
    return sorted(found, key=lambda v: (v.module, v.line, v.imported))


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def folder_of(module: str, packages: set[str]) -> str:
    """The folder a module is in (a package is its own folder); a module directly under
    raypipe/ (``raypipe.trainer``, ``raypipe.config``) is a folder of its own."""
    if module in packages or module.count(".") < 2:
        return module
    return module.rsplit(".", 1)[0]


def cycles(root: Path = PACKAGE_ROOT, by_folder: bool = False) -> list[Cycle]:
    """The import cycles under ``root``, between modules or (``by_folder``) between folders."""
    imports, packages = import_graph(root)
    node = (lambda module: folder_of(module, packages)) if by_folder else (lambda module: module)
    edges: dict[str, set[str]] = {}
    for i in imports:
        if node(i.module) != node(i.imported):
            edges.setdefault(node(i.module), set()).add(node(i.imported))
    found = []
    for members in strongly_connected(edges):
        inside: dict[tuple[str, str], Import] = {}  # between folders: the first import of each pair
        for i in imports:
            pair = (node(i.module), node(i.imported))
            if pair[0] in members and pair[1] in members and pair[0] != pair[1]:
                inside.setdefault(pair if by_folder else (i.module, f"{i.line} {i.imported}"), i)
        found.append(Cycle(tuple(members), tuple(inside.values())))
    return found


def test_no_module_imports_a_higher_layer():
    found = violations()
    assert not found, "imports against the layer order (docs/architecture.md):\n" + "\n".join(map(str, found))


def test_no_import_cycle_between_modules():
    found = cycles()
    assert not found, "import cycles between modules:\n" + "\n".join(map(str, found))


def test_no_import_cycle_between_folders():
    found = cycles(by_folder=True)
    assert not found, "import cycles between folders:\n" + "\n".join(map(str, found))


def test_every_module_is_in_a_layer():
    for path in PACKAGE_ROOT.rglob("*.py"):
        layer_of(module_name(path, PACKAGE_ROOT), path.name == "__init__.py")
    with pytest.raises(AssertionError, match="raypipe.nowhere.fakes is in no layer"):
        layer_of("raypipe.nowhere.fakes")


def _plant(root: Path, packages: Iterable[str], files: dict[str, str]) -> None:
    """A fabricated raypipe package under ``root``: ``packages`` (empty ``__init__.py``s), then
    ``files`` (path under ``root``: source)."""
    for package in ("", *packages):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for path, source in files.items():
        (root / path).write_text(source)


def test_checker_catches_a_fabricated_violation(tmp_path):
    root = tmp_path / "raypipe"
    _plant(root, ("core", "runtime", "stage", "checkpoint", "checkpoint_manager"), {
        "runtime/group.py": "X = 1\n",
        "checkpoint/store.py": "",
        "checkpoint_manager/trainer_state.py": "from raypipe.runtime import group  # the manager: allowed\n",
        # a package's __init__ runs whenever one of its modules is imported: it is in the package's lowest layer
        "checkpoint/__init__.py": "from raypipe.checkpoint_manager import trainer_state  # counts\n",
        "stage/worker.py": (
            "from ..core import schedule  # downward: allowed\n"
            "from raypipe.checkpoint import store  # checkpoint storage, below the stage: allowed\n"
            "class Worker:\n"
            "    def save(self):\n"
            "        try:\n"
            "            from raypipe.checkpoint_manager import trainer_state  # the manager, above: counts\n"
            "        except ImportError:\n"
            "            pass\n"),
        "core/schedule.py": (
            "def make():\n"
            "    import importlib\n"
            "    importlib.import_module('raypipe.runtime.group')  # a literal name: counts\n"
            "    from ..runtime import group  # in a function body: counts\n"
            "    import raypipe.stage.worker  # counts\n"
            "    from raypipe.core import schedule  # itself: no edge\n"),
    })
    found = violations(root)
    assert [(v.module, v.line, v.imported, v.module_layer, v.imported_layer) for v in found] == [
        ("raypipe.checkpoint", 1, "raypipe.checkpoint_manager.trainer_state", "checkpoint storage", "checkpoint manager"),
        ("raypipe.core.schedule", 3, "raypipe.runtime.group", "core", "runtime"),
        ("raypipe.core.schedule", 4, "raypipe.runtime.group", "core", "runtime"),
        ("raypipe.core.schedule", 5, "raypipe.stage.worker", "core", "stage"),
        ("raypipe.stage.worker", 6, "raypipe.checkpoint_manager.trainer_state", "stage", "checkpoint manager"),
    ]
    assert str(found[2]) == ("raypipe.core.schedule line 4 imports raypipe.runtime.group: "
                             "layer 'core' imports the higher layer 'runtime'")


def test_checker_catches_a_planted_cycle_and_an_upward_type_checking_import(tmp_path):
    root = tmp_path / "raypipe"
    _plant(root, ("core", "models", "runtime", "stage"), {
        "runtime/group.py": "class StageGroup: ...\n",
        # an annotation-only import of a higher layer, under TYPE_CHECKING, is still an upward import
        "core/result.py": (
            "from __future__ import annotations\n"
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from raypipe.runtime.group import StageGroup\n"
            "def describe(group: StageGroup) -> str: ...\n"),
        # a cycle inside one layer, closed by a TYPE_CHECKING import and a function-local one
        "models/llama.py": "def layers():\n    from raypipe.models.llama_costs import costs\n",
        "models/llama_costs.py": "from raypipe.models import llama_memory\n",
        "models/llama_memory.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from raypipe.models.llama import LlamaConfig\n"),
        # a package's __init__ that re-exports its submodule is an edge; the submodule reaching back
        # for a name in that __init__ closes a cycle
        "stage/__init__.py": "from raypipe.stage.worker import Worker\n",
        "stage/worker.py": "from raypipe.stage import DEFAULTS\nclass Worker: ...\n",
        # a downward import between two folders is fine alone: with one back it is a folder cycle
        "runtime/spares.py": "from raypipe.stage.worker import Worker\n",
        "stage/gradients.py": "def clip():\n    from raypipe.runtime import group\n",
    })

    assert [str(v) for v in violations(root)] == [
        "raypipe.core.result line 4 imports raypipe.runtime.group: layer 'core' imports the higher layer 'runtime'",
        "raypipe.stage.gradients line 2 imports raypipe.runtime.group: "
        "layer 'stage' imports the higher layer 'runtime'",
    ]
    found = cycles(root)
    assert [c.members for c in found] == [
        ("raypipe.models.llama", "raypipe.models.llama_costs", "raypipe.models.llama_memory"),
        ("raypipe.stage", "raypipe.stage.worker"),
    ]
    assert [(i.module, i.line, i.imported) for i in found[0].imports] == [
        ("raypipe.models.llama", 2, "raypipe.models.llama_costs"),
        ("raypipe.models.llama_costs", 1, "raypipe.models.llama_memory"),
        ("raypipe.models.llama_memory", 3, "raypipe.models.llama"),
    ]
    assert str(found[1]) == ("import cycle among raypipe.stage, raypipe.stage.worker: "
                             "raypipe.stage line 1 imports raypipe.stage.worker; "
                             "raypipe.stage.worker line 1 imports raypipe.stage")
    assert [c.members for c in cycles(root, by_folder=True)] == [("raypipe.runtime", "raypipe.stage")]
    # without the import that closes each, no cycle is left; a new one between two modules fails
    (root / "models" / "llama_memory.py").write_text("")
    (root / "stage" / "worker.py").write_text("class Worker: ...\n")
    assert cycles(root) == []
    (root / "core" / "ops.py").write_text("from raypipe.core import result\n")
    (root / "core" / "result.py").write_text("from raypipe.core import ops\n")
    assert [c.members for c in cycles(root)] == [("raypipe.core.ops", "raypipe.core.result")]
