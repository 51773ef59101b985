"""Two rules of the code's shape, enforced on every module under ``megatron/`` and ``tools/``.

- **No function takes more than 8 parameters** (``self``/``cls`` and ``**`` catch-alls aside): options that
  belong together are one frozen value (``Overlap``, ``PerMatrixOptimizer``, ``GradNorm``, ``MetaInit``, ...). The public ``fully_shard``
  is the one exception (``WIDE_BY_DESIGN``), for the reason written there.
- **The job's components take typed views, not the run's namespace.** In ``megatron/fsdp_training/`` outside the
  ``arguments`` package (which builds the namespace) a function whose parameter is the whole namespace
  (``args``) is a view's ``from_args`` or one of ``TAKES_NAMESPACE``,
  each for the reason written beside it; everything else reads a frozen view built once from it
  (``LoopConfig``, ``CheckpointConfig``, ``DataConfig``, ...).
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Dict, Iterator, List, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 8
NAMESPACE = "args"

# module (relative path) :: function -> why it has more than MAX_PARAMETERS parameters
WIDE_BY_DESIGN: Dict[str, str] = {
    "megatron/fsdp/wrap/build.py::fully_shard": (
        "the public entry point's keyword options, each one concept of its own (module, unit classes, the mesh and "
        "its two levels, precision, weight-decay rule, averaging, experts, overlap, meta init); grouping the mesh "
        "with its levels would make every plain call nest it, unlike FSDP2's fully_shard"),
}

# module (relative path) :: function -> why it reads the whole namespace
TAKES_NAMESPACE: Dict[str, str] = {
    # the entry point: the command line's namespace, handed to the one object that maps it
    "megatron/fsdp_training/training.py::pretrain": "the entry point: one run of the command line's arguments",
    "megatron/fsdp_training/training.py::run_entry_point": "the entry point: a user error one line, exit status 2",
    "megatron/fsdp_training/trainer.py::Trainer.__init__": "the run holds its arguments until setup maps them into views",
    "megatron/fsdp_training/job_setup.py::setup": (
        "validates the arguments, writes the tokenizer's vocabulary sizes into them, then maps them (below)"),
    "megatron/fsdp_training/tools/generate.py::run": "the generation command's entry point (the job's own flags)",
    "megatron/fsdp_training/tools/estimate/cli.py::run": "the estimate command's entry point (the job's own flags)",
    "megatron/fsdp_training/tools/estimate/one_step.py::measure_one_step": (
        "builds the job from its arguments as the entry point does (hands them to the Trainer), then measures it"),
    # the mappers: flags into Megatron-Core's own typed configs (Megatron-LM's core_transformer_config_from_args)
    "megatron/fsdp_training/model.py::transformer_config": "the flags into Megatron-Core's (MLA)TransformerConfig",
    "megatron/fsdp_training/model_shape.py::transformer_config_fields": (
        "the shape flags as TransformerConfig fields, shared by the job, the logs and the checkpoint tools"),
    "megatron/fsdp_training/model.py::optimizer_config": "the flags into Megatron-Core's OptimizerConfig",
    "megatron/fsdp_training/model.py::optimizer_precision": "the flags into the engine's OptimizerPrecision",
    "megatron/fsdp_training/model.py::ddp_config": (
        "the flags into the data-parallel wrapper's config, the engine's or Megatron-Core's: the one place the "
        "choice is made"),
    "megatron/fsdp_training/tools/checkpoint_tools/hf_models.py::arch_from_args": (
        "a checkpoint's recorded arguments into its Hugging Face shape"),
    # a tool's own command line (its subcommand and paths), not the job's flags
    "megatron/fsdp_training/tools/checkpoint_tools/convert.py::_run": (
        "the conversion tool's own parsed command line, dispatched to the subcommand it names"),
    "megatron/fsdp_training/tools/checkpoint_tools/convert.py::_run_hf_command": (
        "to-hf / from-hf read most of the conversion tool's own command line (paths, dtype, model type)"),
    # what prints the arguments themselves
    "megatron/fsdp_training/logs/lines.py::summary": "prints Megatron-LM's start-up block of every argument",
}


def _functions(source: str) -> Iterator[Tuple[str, ast.FunctionDef]]:
    """Every function of a module with its dotted name inside the module (``Class.method``)."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(ast.parse(source), "")


def _named_parameters(fn: ast.FunctionDef) -> List[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]


def _modules(tops=("megatron", "tools")):
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()


def too_many_parameters(modules) -> List[str]:
    return [f"{rel}::{name} ({len(_named_parameters(fn))})" for rel, source in modules
            for name, fn in _functions(source) if len(_named_parameters(fn)) > MAX_PARAMETERS]


def namespace_takers(modules) -> List[str]:
    """The job's functions (outside its arguments package) with a parameter named ``args`` among their first two:
    the namespace (``*args`` is a different thing and not counted)."""
    found = []
    for rel, source in modules:
        if not rel.startswith("megatron/fsdp_training/") or "/arguments/" in rel:
            continue
        for name, fn in _functions(source):
            if NAMESPACE in _named_parameters(fn)[:2] and not name.endswith(".from_args"):  # a view's one mapping
                found.append(f"{rel}::{name}")
    return found


HISTORY = re.compile(r"\bissues? ?\d+|\bmeasured (on )?20\d\d-", re.I)  # what git holds, not the code


def test_code_says_what_is_true_now():
    """No issue numbers or dated measurements in code and tests (docs: tests/docs); git holds the history."""
    found = [f"{rel}:{i}" for rel, source in _modules(("megatron", "tools", "tests", "examples"))
             for i, line in enumerate(source.splitlines(), 1) if HISTORY.search(line)]
    assert found == [], found


def test_no_function_takes_more_than_eight_parameters():
    wide = {row.split(" (")[0] for row in too_many_parameters(_modules())}
    assert wide == set(WIDE_BY_DESIGN), wide


def test_only_the_listed_functions_take_the_whole_namespace():
    found = namespace_takers(_modules())
    assert sorted(found) == sorted(TAKES_NAMESPACE), (
        "not listed: " + ", ".join(sorted(set(found) - set(TAKES_NAMESPACE)))
        + " | listed but gone: " + ", ".join(sorted(set(TAKES_NAMESPACE) - set(found))))
    assert all(len(why) > 20 for why in TAKES_NAMESPACE.values())


def test_the_rules_catch_what_they_describe():
    source = ("def build(args, cpu):\n    return args.hidden_size\n"
              "class Saver:\n    def save(self, args):\n        pass\n"
              "    @classmethod\n    def from_args(cls, args):\n        pass\n"
              "def wide(a, b, c, d, e, f, g, h, i):\n    pass\n"
              "def narrow(a, *args, **kwargs):\n    pass\n")
    modules = [("megatron/fsdp_training/y.py", source), ("megatron/fsdp_training/arguments/z.py", source),
               ("megatron/fsdp/x.py", source)]
    assert namespace_takers(modules) == ["megatron/fsdp_training/y.py::build", "megatron/fsdp_training/y.py::Saver.save"]
    assert too_many_parameters(modules) == [f"{rel}::wide (9)" for rel, _ in modules]
