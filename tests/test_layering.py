"""The layering of docs/index.md, enforced: which package may import which, no import cycles, no borrowing of tests/.

Every ``import`` of every module under ``megatron/`` counts, function-level (lazy) ones too: a
lazy import is still a dependency, and a cycle hidden in a function body is still a cycle. The
table ``MAY_IMPORT`` is the one statement of the allowed directions; docs/index.md draws it.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
from typing import Dict, List, Set

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

ENGINE = ("collectives", "precision", "warnings", "commands", "sharding", "schedule", "init", "checkpoint", "wrap",
          "optim", "engine_api")
# Layer of a module: the longest matching prefix wins.
LAYERS = {
    "megatron.fsdp": "engine_api",  # the package's __init__: the public API, re-exported
    "megatron.fsdp.library_warnings": "warnings",
    "megatron.fsdp.warn_once": "warnings",
    "megatron.fsdp.commands": "commands",
    **{f"megatron.fsdp.{name}": name for name in
       ("collectives", "precision", "sharding", "schedule", "init", "checkpoint", "wrap", "optim")},
    "megatron.fsdp.testing": "engine_testing",
    "megatron.fsdp.mcore_releases": "releases",  # every Megatron-Core release difference, beside the adapter
    "megatron.fsdp.mcore_cpu": "mcore_cpu",  # Megatron-Core and Transformer Engine emulated on CPU
    "megatron.fsdp.mcore": "adapter",
    "megatron.fsdp_training": "job",
    "megatron.fsdp_training.errors": "errors",
    "megatron.fsdp_training.model_shape": "architecture",  # the model's shape as Megatron-Core's config fields
    "megatron.fsdp_training.data": "data",
    "megatron.fsdp_training.logs": "logs",
    "megatron.fsdp_training.checkpointing": "checkpointing",
    "megatron.fsdp_training.testing": "job_testing",
    "megatron.fsdp_training.tools": "job_tools",
    "megatron.core": "megatron_core",
    "tests": "tests",
    "tools": "tools",
    "examples": "examples",
}
MAY_IMPORT: Dict[str, Set[str]] = {
    # the engine: torch only, bottom to top
    "collectives": set(),
    "precision": set(),
    "warnings": set(),
    "commands": set(),  # the installed commands' names, for any line that tells a user what to run
    "sharding": {"collectives", "precision"},
    "schedule": {"collectives", "sharding"},
    "init": {"collectives"},
    "checkpoint": {"collectives", "precision", "sharding", "schedule"},
    "wrap": {"collectives", "precision", "warnings", "sharding", "schedule", "init", "checkpoint"},
    "optim": {"collectives", "precision", "warnings", "sharding", "checkpoint", "wrap"},
    "engine_api": set(ENGINE) - {"engine_api"},
    "engine_testing": set(ENGINE),
    # the Megatron-Core release differences, then the CPU emulation, then the adapter: the engine never imports them
    "releases": {"megatron_core"},
    "mcore_cpu": set(ENGINE) | {"releases", "megatron_core"},
    "adapter": set(ENGINE) | {"releases", "mcore_cpu", "megatron_core"},
    # the job: its leaves, then the rest
    "errors": set(),
    "architecture": {"errors"},
    "data": {"errors", "commands", "releases", "megatron_core"},
    "logs": {"errors", "architecture", "releases", "megatron_core"},
    "checkpointing": set(ENGINE) | {"adapter", "mcore_cpu", "releases", "megatron_core", "errors", "logs"},
    "job": set(ENGINE) | {"adapter", "mcore_cpu", "releases", "megatron_core", "errors", "architecture", "data", "logs",
                          "checkpointing"},
    "job_testing": set(ENGINE) | {"engine_testing", "adapter", "mcore_cpu", "releases", "megatron_core", "errors",
                                  "architecture", "data", "logs", "checkpointing", "job"},
    # the job's installed tools (checkpoint conversion, preprocessing, generation): the job and all below it
    "job_tools": set(ENGINE) | {"adapter", "mcore_cpu", "releases", "megatron_core", "errors", "architecture",
                                "data", "logs", "checkpointing", "job"},
}


def layer_of(module: str):
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return best[1] if best else None


def modules_under(root: pathlib.Path) -> Dict[str, pathlib.Path]:
    found = {}
    for path in sorted((root / "megatron").rglob("*.py")):
        if "core" in path.relative_to(root / "megatron").parts[:1]:
            continue  # a megatron-core checkout beside ours is not ours
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def imports_of(name: str, path: pathlib.Path, known) -> Set[str]:
    """Every module ``name`` imports (lazy imports too); ``from pkg import mod`` counts as ``pkg.mod``."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            out.update(subs if len(subs) == len(node.names) else [target, *subs])
    return {t for t in out if t != name}


def import_graph(root: pathlib.Path) -> Dict[str, Set[str]]:
    mods = modules_under(root)
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def layer_violations(graph: Dict[str, Set[str]]) -> List[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs is None or theirs == mine:
                continue
            if theirs not in MAY_IMPORT.get(mine, set()):
                problems.append(f"{module} ({mine}) imports {target} ({theirs}); {mine} may import "
                                f"{sorted(MAY_IMPORT.get(mine, set())) or 'nothing of ours'}")
    return problems


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iteration order fixed)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def borrowers_of_tests(root: pathlib.Path) -> List[str]:
    """Files of tools/, examples/ and megatron/ that import tests/ (they break outside pytest)."""
    out = []
    for folder in ("tools", "examples", "megatron"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                if any(n == "tests" or n.startswith("tests.") for n in names):
                    out.append(str(path.relative_to(root)))
                    break
    return out


def test_every_module_has_a_layer_and_every_package_says_what_it_may_import():
    graph = import_graph(ROOT)
    assert [m for m in graph if layer_of(m) is None] == []
    for init in sorted((ROOT / "megatron").rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if init.parent.name in ("fsdp", "fsdp_training", "mcore"):
            continue  # the two products' and the adapter's own docs (docs/) say it at length
        assert "May import" in doc, f"{init.relative_to(ROOT)}: its docstring must say what the package may import"


def test_the_tree_keeps_the_layering():
    graph = import_graph(ROOT)
    assert layer_violations(graph) == []
    assert cycles(graph) == []
    assert borrowers_of_tests(ROOT) == []


@pytest.fixture()
def tree_copy(tmp_path):
    shutil.copytree(ROOT / "megatron", tmp_path / "megatron")
    shutil.copytree(ROOT / "tools", tmp_path / "tools")
    (tmp_path / "examples").mkdir()
    return tmp_path


def _append(path: pathlib.Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_a_forbidden_import_fails(tree_copy):
    # the sharding core reaching up into the optimizer, inside a function (a lazy import counts)
    _append(tree_copy / "megatron/fsdp/sharding/layout.py",
            "\n\ndef _upward():\n    from ..optim import optimizer  # noqa: F401\n")
    problems = layer_violations(import_graph(tree_copy))
    assert len(problems) == 1 and problems[0].startswith(
        "megatron.fsdp.sharding.layout (sharding) imports megatron.fsdp.optim.optimizer (optim)")
    # the engine importing Megatron-Core
    _append(tree_copy / "megatron/fsdp/collectives/comm.py", "\nimport megatron.core  # noqa: F401,E402\n")
    assert any("(megatron_core)" in p for p in layer_violations(import_graph(tree_copy)))


def test_a_cycle_fails(tree_copy):
    _append(tree_copy / "megatron/fsdp/collectives/gloo_ring.py",
            "\n\ndef _back():\n    from .comm import Ledger  # noqa: F401\n")
    assert cycles(import_graph(tree_copy)) == [["megatron.fsdp.collectives.comm",
                                                "megatron.fsdp.collectives.gloo_ring"]]


def test_a_tool_that_borrows_tests_fails(tree_copy):
    (tree_copy / "examples" / "borrow.py").write_text("from tests.harness import WorkerPool\n")
    assert borrowers_of_tests(tree_copy) == ["examples/borrow.py"]


# The test-support packages are whole rows of their own and are being moved separately.
NAME_CHECK_SKIPS = ("megatron/fsdp/testing", "megatron/fsdp_training/testing")


def reused_names(root: pathlib.Path) -> Dict[str, List[str]]:
    """Module basenames and package directory names under megatron/fsdp and megatron/fsdp_training that occur
    more than once (``__init__``, ``__main__`` and the test-support packages aside), each with its paths."""
    seen: Dict[str, List[str]] = {}
    for top in ("megatron/fsdp", "megatron/fsdp_training"):
        for path in sorted((root / top).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if any(rel == skip or rel.startswith(skip + "/") for skip in NAME_CHECK_SKIPS) or "__pycache__" in rel:
                continue
            if path.is_dir() and (path / "__init__.py").is_file():
                seen.setdefault(path.name, []).append(rel + "/")
            elif path.suffix == ".py" and path.stem not in ("__init__", "__main__"):
                seen.setdefault(path.stem, []).append(rel)
    return {name: paths for name, paths in sorted(seen.items()) if len(paths) > 1}


def test_every_module_name_says_its_concern_once():
    # A name used twice (``schedule`` for the engine's hooks, the pipeline hooks and the batch ramp-up) makes a
    # reader, a traceback and a grep guess which one is meant: each module and package is named for its concern.
    assert reused_names(ROOT) == {}, "reused module or package names: " + "; ".join(
        f"{name}: {', '.join(paths)}" for name, paths in reused_names(ROOT).items())


def test_a_reused_module_name_fails(tree_copy):
    (tree_copy / "megatron/fsdp/mcore/profiling.py").write_text('"""A second profiling module."""\n')
    assert reused_names(tree_copy) == {"profiling": ["megatron/fsdp/collectives/profiling.py",
                                                     "megatron/fsdp/mcore/profiling.py"]}


# How a matrix is sampled (no case, no check): the one module any test or helper may add to its reading.
SAMPLER = "tests.cases.level_matrix"


def modules_of_tests_imported(root: pathlib.Path, path: pathlib.Path) -> Set[str]:
    """The modules of tests/ that ``path`` imports, lazily too (``from tests.cases import hf``: ``tests.cases.hf``)."""
    def exists(module: str) -> bool:
        base = root.joinpath(*module.split("."))
        return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()

    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "tests")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tests":
            subs = [f"{node.module}.{a.name}" for a in node.names if exists(f"{node.module}.{a.name}")]
            out.update(subs if len(subs) == len(node.names) else [node.module, *subs])
    return out


def reading_violations(root: pathlib.Path) -> List[str]:
    """Test modules of ``tests/<layer>/`` that read in more than themselves and one helper (or another test
    module), and helpers there that import another module of tests/ (``SAMPLER`` aside)."""
    problems = []
    for path in sorted((root / "tests").rglob("*.py")):
        relative = path.relative_to(root)
        if len(relative.parts) < 3 or path.name in ("__init__.py", "conftest.py"):
            continue  # tests/test_*.py check the repository itself; conftest.py is pytest's
        read = sorted(m for m in modules_of_tests_imported(root, path) if m != SAMPLER)
        tests_read = [m for m in read if m.rsplit(".", 1)[-1].startswith("test_") or m.endswith(".conftest")]
        allowed = 1 if path.name.startswith("test_") else 0
        if tests_read or len(read) > allowed:
            problems.append(f"{relative.as_posix()} reads {', '.join(read)}")
    return problems


def test_a_test_reads_in_its_module_and_one_helper():
    # What a test runs and checks is in two files at most: its module (with its own worker-side cases) and one
    # shared helper (docs/testing.md, "Where things live").
    assert reading_violations(ROOT) == []


def test_a_test_that_reads_a_third_file_fails(tmp_path):
    (tmp_path / "tests" / "cases").mkdir(parents=True)
    (tmp_path / "tests" / "engine").mkdir()
    for name in ("a", "b", "level_matrix"):
        (tmp_path / "tests" / "cases" / f"{name}.py").write_text("X = 1\n")
    (tmp_path / "tests" / "cases" / "c.py").write_text("from tests.cases.a import X  # noqa: F401\n")
    (tmp_path / "tests" / "engine" / "test_one.py").write_text(
        "from tests.cases import a, level_matrix  # noqa: F401\n")
    (tmp_path / "tests" / "engine" / "test_two.py").write_text(
        "from tests.cases.a import X  # noqa: F401\n\n\ndef test():\n    from tests.cases.b import X  # noqa: F401\n")
    (tmp_path / "tests" / "engine" / "test_three.py").write_text("from tests.engine.test_one import a  # noqa: F401\n")
    assert reading_violations(tmp_path) == ["tests/cases/c.py reads tests.cases.a",
                                            "tests/engine/test_three.py reads tests.engine.test_one",
                                            "tests/engine/test_two.py reads tests.cases.a, tests.cases.b"]
