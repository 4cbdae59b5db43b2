"""A lower layer never imports a higher one: every import in every module under raypipe/
(in function bodies too; ``if TYPE_CHECKING:`` blocks excepted) is checked against the
order below, read from the source with ``ast`` (no module is run, so no Ray is needed).
docs/architecture.md ("Layer order") states the same order."""
from __future__ import annotations

import ast
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
    # pure computations over the above, no Ray: the executor re-partitions with planning's
    # memory model, and the controller can export its state through observability's metrics
    ("planning and observability", ("raypipe.planning", "raypipe.observability")),
    # the failure and scaling policies: pure decisions over a frozen view (no Ray, no I/O),
    # asked by the mechanisms in executor/ and control/
    ("control decisions", ("raypipe.control.view", "raypipe.control.policy")),
    ("checkpoint storage", ("raypipe.checkpoint",)),  # store, parts, hf_export (reads files, writes HF shards)
    ("comm", ("raypipe.comm",)),
    ("stage", ("raypipe.stage",)),
    # the in-process interpreter of lowered ops runs stage workers (no Ray): a testing aid above the stage
    ("stage testing aids", ("raypipe.testing.op_interpreter",)),
    ("runtime", ("raypipe.runtime",)),
    ("executor", ("raypipe.executor",)),
    ("control", ("raypipe.control",)),
    ("checkpoint manager", ("raypipe.checkpoint.trainer_state", "raypipe.checkpoint.pending")),
    ("entry points", ("raypipe.trainer", "raypipe.fit", "raypipe.run", "raypipe.cli")),
]
TOP = "raypipe"  # raypipe/__init__.py, the facade: in the top layer


def layer_of(module: str, is_package: bool = False) -> int:
    """The index in LAYERS of ``module`` (dotted name under raypipe): the longest listed name
    that covers it. A subpackage's __init__.py runs before any of its modules, so a package
    is in its lowest layer (``raypipe.checkpoint`` is checkpoint storage, not the manager)."""
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


def module_name(path: Path, root: Path) -> str:
    """``raypipe/checkpoint/store.py`` -> ``raypipe.checkpoint.store``; a package's __init__.py is the package."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth, outside ``if TYPE_CHECKING:`` bodies."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)  # the else branch runs
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
                     known: set[str]) -> list[str]:
    """The raypipe modules an import statement loads (relative imports resolved; ``from pkg import sub``
    names the submodule ``pkg.sub`` where one exists, else ``pkg``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "raypipe"]
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


def violations(root: Path = PACKAGE_ROOT) -> list[Violation]:
    """Every import under ``root`` (the raypipe package folder) of a layer above the importer's."""
    paths = sorted(root.rglob("*.py"))
    packages = {module_name(path, root) for path in paths if path.name == "__init__.py"}
    known = {module_name(path, root) for path in paths}
    found = set()
    for path in paths:
        module = module_name(path, root)
        own = layer_of(module, module in packages)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            for imported in imported_modules(node, module, module in packages, known):
                other = layer_of(imported, imported in packages)
                if other > own:
                    found.add(Violation(module, node.lineno, imported, LAYERS[own][0], LAYERS[other][0]))
    return sorted(found, key=lambda v: (v.module, v.line, v.imported))


def test_no_module_imports_a_higher_layer():
    found = violations()
    assert not found, "imports against the layer order (docs/architecture.md):\n" + "\n".join(map(str, found))


def test_every_module_is_in_a_layer():
    for path in PACKAGE_ROOT.rglob("*.py"):
        layer_of(module_name(path, PACKAGE_ROOT), path.name == "__init__.py")
    with pytest.raises(AssertionError, match="raypipe.nowhere.fakes is in no layer"):
        layer_of("raypipe.nowhere.fakes")


def test_checker_catches_a_fabricated_violation(tmp_path):
    root = tmp_path / "raypipe"
    for package in ("", "core", "runtime", "stage", "checkpoint"):
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "runtime" / "group.py").write_text("X = 1\n")
    (root / "checkpoint" / "store.py").write_text("")
    (root / "checkpoint" / "trainer_state.py").write_text("from raypipe.runtime import group  # the manager: allowed\n")
    # a package's __init__ runs whenever one of its modules is imported: it is in the package's lowest layer
    (root / "checkpoint" / "__init__.py").write_text("from . import trainer_state\n")
    (root / "stage" / "worker.py").write_text(
        "from ..core import schedule  # downward: allowed\n"
        "from raypipe.checkpoint import store  # checkpoint storage, below the stage: allowed\n"
        "class Worker:\n"
        "    def save(self):\n"
        "        try:\n"
        "            from raypipe.checkpoint import trainer_state  # the manager, above: counts\n"
        "        except ImportError:\n"
        "            pass\n")
    (root / "core" / "schedule.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from raypipe.runtime.group import X  # not run: allowed\n"
        "def make():\n"
        "    from ..runtime import group  # in a function body: counts\n"
        "    import raypipe.stage.worker  # counts\n"
        "    from raypipe.core import schedule  # same layer: allowed\n")
    found = violations(root)
    assert [(v.module, v.line, v.imported, v.module_layer, v.imported_layer) for v in found] == [
        ("raypipe.checkpoint", 1, "raypipe.checkpoint.trainer_state", "checkpoint storage", "checkpoint manager"),
        ("raypipe.core.schedule", 5, "raypipe.runtime.group", "core", "runtime"),
        ("raypipe.core.schedule", 6, "raypipe.stage.worker", "core", "stage"),
        ("raypipe.stage.worker", 6, "raypipe.checkpoint.trainer_state", "stage", "checkpoint manager"),
    ]
    assert str(found[1]) == ("raypipe.core.schedule line 5 imports raypipe.runtime.group: "
                             "layer 'core' imports the higher layer 'runtime'")
