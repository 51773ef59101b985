"""The wheel works where there is no clone: each installed command, run from a directory outside it.

What a user of ``pip install .`` has is the wheel's packages and its console scripts: no
``pretrain_gpt.py`` and no ``tools/``. So the wheel built from this clone goes into a fresh venv
that sees the running interpreter's torch and megatron-core through a ``.pth`` of its site
directories (``.pth`` files inside those are not processed, so an editable install's finder,
which would map ``megatron.fsdp`` back to a clone, stays out), and every command runs from a
temporary directory: the job trains 2 iterations and saves, the inspector and the converter read
that checkpoint, generation continues a prompt from it, the estimate simulates rank 7 of 512, preprocessing
writes a dataset, and
``python -m`` of the job's package and of its training module reach the job's parser.
"""

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from megatron.fsdp import commands
from tests.cases.packaging import ROOT, pip_env, probe_site, running_site_dirs, sources

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "63"]
TRAIN = SHAPE + ["--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--use-megatron-fsdp",
                 "--train-iters", "2", "--eval-iters", "1", "--save", "ckpt"]
DOCUMENTS = ("first document", "the second one", "a third")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """(the venv, the wheel): the wheel built from this clone, installed alone (``--no-deps``) into the venv."""
    root = tmp_path_factory.mktemp("installed")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-w", str(root / "wheels"), str(sources(root / "src"))],
                           capture_output=True, text=True, env=pip_env(), timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (root / "wheels").glob("megatron_fsdp_backend-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    (Path(probe_site(python)) / "running_interpreter.pth").write_text("\n".join(running_site_dirs()) + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--no-compile", str(wheel)], capture_output=True, text=True, env=pip_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "venv", wheel


def _start(venv: Path, cwd: Path, command: str, *argv: str) -> subprocess.Popen:
    """``command`` of the venv (a console script, or ``python``) in ``cwd``, without this clone on any path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([str(venv / "bin" / command), *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(env, OMP_NUM_THREADS="1"))


def _finish(process: subprocess.Popen, expected: int = 0) -> str:
    out = process.communicate(timeout=300)[0]
    assert process.returncode == expected, f"{process.args} exited {process.returncode}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def trained(venv, tmp_path_factory):
    """The training command's run (and, beside it, preprocessing's) in a directory outside the clone."""
    where = tmp_path_factory.mktemp("run")
    (where / "tiny.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in DOCUMENTS))
    runs = {"pretrain": _start(venv[0], where, commands.PRETRAIN, *TRAIN),
            "preprocess": _start(venv[0], where, commands.PREPROCESS, "--input", "tiny.jsonl", "--tokenizer-type",
                                 "ByteLevelTokenizer", "--output-prefix", "data/tiny", "--append-eod")}
    return where, {name: _finish(process) for name, process in runs.items()}


def test_the_wheel_is_what_runs_and_its_commands_are_the_ones_named(venv, tmp_path):
    where, wheel = venv
    found = subprocess.run([str(where / "bin" / "python"), "-c", "import megatron.fsdp, megatron.fsdp_training.tools; "
                            "print(megatron.fsdp.__file__)"], capture_output=True, text=True, cwd=tmp_path,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=120)
    assert found.returncode == 0, found.stderr
    location = Path(found.stdout.strip()).resolve()
    assert location.is_relative_to(where.resolve()) and not location.is_relative_to(ROOT), location
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    named = {commands.PRETRAIN, commands.CONVERT, commands.INSPECT, commands.PREPROCESS, commands.GENERATE,
             commands.ESTIMATE}
    with zipfile.ZipFile(wheel) as archive:
        entry_points = next(archive.read(n).decode() for n in archive.namelist() if n.endswith("entry_points.txt"))
    assert set(scripts) == named and all(f"{name} = {scripts[name]}" in entry_points for name in named), entry_points
    assert all((where / "bin" / name).is_file() for name in named)


def test_the_training_command_trains_and_saves(trained):
    where, out = trained
    assert "iteration        2/       2" in out["pretrain"] and "training done | iterations: 2" in out["pretrain"], \
        out["pretrain"][-3000:]
    assert (where / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (where / "ckpt" / "iter_0000002" / "common.json").is_file()


def test_python_dash_m_reaches_the_job(venv, tmp_path):
    """``python -m`` of the package and of its training module run the job (its parser's one-line error)."""
    runs = [_start(venv[0], tmp_path, "python", "-m", module, "--no-such-flag")
            for module in ("megatron.fsdp_training", "megatron.fsdp_training.training")]
    for process in runs:
        out = _finish(process, expected=2)
        assert f"error: unrecognized arguments: --no-such-flag ({commands.PRETRAIN} --help" in out, out[-3000:]


def test_the_tools_read_the_checkpoint_and_preprocess(venv, trained):
    import torch

    where, out = trained
    runs = {"inspect": _start(venv[0], where, commands.INSPECT, "ckpt"),
            "convert": _start(venv[0], where, commands.CONVERT, "to-torch", "ckpt", "full.pt"),
            "generate": _start(venv[0], where, commands.GENERATE, "--load", "ckpt", "--prompt", "1 2 3",
                               "--max-new-tokens", "4", "--greedy", "--no-stop-at-eod"),
            "estimate": _start(venv[0], where, commands.ESTIMATE, "--world-size", "512", "--rank", "7", *TRAIN,
                               "--global-batch-size", "1024")}
    out.update({name: _finish(process) for name, process in runs.items()})
    assert "format fsdp_dtensor" in out["inspect"] and "iteration 2," in out["inspect"], out["inspect"]
    assert "wrote full.pt from" in out["convert"], out["convert"]
    state = torch.load(where / "full.pt", weights_only=False)
    assert state["common"]["iteration"] == 2 and any(k.startswith("embedding.") for k in state["model"])
    assert "generated 4 tokens" in out["generate"], out["generate"][-3000:]
    continued = next(line for line in out["generate"].splitlines() if line.startswith("1 2 3 ")).split()
    assert len(continued) == 7 and all(token.isdigit() for token in continued), continued
    assert "estimate of rank 7 of 512 (a simulation" in out["estimate"], out["estimate"][-3000:]
    assert "--save replaced" in out["estimate"], out["estimate"][-3000:]  # it writes nothing
    assert f"Done: {len(DOCUMENTS)} input documents" in out["preprocess"], out["preprocess"]
    assert all((where / "data" / f"tiny_text_document{ext}").stat().st_size > 0 for ext in (".bin", ".idx"))
