"""The project installs into an environment that already has torch and megatron-core, and leaves them as they were.

What a user with their own stack does (an NGC container, a newer Megatron-Core): a venv that sees the
running interpreter's packages (its site directories on the venv's path: the torch and the megatron-core
this suite runs on, whether that interpreter is a system one or itself a venv), the project installed into
it the non-editable way, with no index to download from
(``--no-index``: a requirement the environment does not already meet fails instead of replacing it),
then:

- torch and megatron-core are the same distributions as before (version and location);
- no file the project installed has a path that the installed megatron-core also ships
  (megatron-core >= 0.17 ships Megatron-LM's ``megatron/training``; both live in the ``megatron``
  namespace package), and the project ships no ``megatron/__init__.py`` of its own.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "megatron-fsdp-backend"
KEPT = ("torch", "megatron-core")

_PROBE = r"""
import json, sys
import importlib.metadata as md
out = {}
for name in sys.argv[1:]:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        out[name] = None
        continue
    out[name] = {"version": dist.version, "location": str(dist.locate_file("")),
                 "files": sorted(str(f) for f in (dist.files or []))}
print(json.dumps(out))
"""


def _probe(python: Path, *names: str) -> dict:
    out = subprocess.run([str(python), "-c", _PROBE, *names], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _running_site_dirs() -> list:
    dirs = site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def _probe_site(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def _pip_env() -> dict:
    """pip without this machine's configuration (its find-links, extra indexes, constraints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return dict(env, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")


def _sources(into: Path) -> Path:
    """What a wheel is built from (a copy: the build leaves build/ and *.egg-info behind)."""
    into.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, into / name)
    shutil.copytree(ROOT / "megatron", into / "megatron", ignore=shutil.ignore_patterns("__pycache__", "core"))
    return into


def test_install_keeps_torch_and_megatron_core_and_ships_none_of_their_files(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # the running interpreter's packages, after the venv's own (a .pth line is appended to sys.path)
    ours_site = _probe_site(python)
    (Path(ours_site) / "running_interpreter.pth").write_text("\n".join(_running_site_dirs()) + "\n")
    before = _probe(python, *KEPT)
    assert all(before[name] for name in KEPT), before
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                          "--no-build-isolation", "--no-compile", str(_sources(tmp_path / "src"))],
                         capture_output=True, text=True, env=_pip_env(), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    after = _probe(python, *KEPT, PROJECT)
    for name in KEPT:
        assert {k: after[name][k] for k in ("version", "location")} == \
            {k: before[name][k] for k in ("version", "location")}, (name, out.stdout[-2000:])
    ours = after[PROJECT]
    assert Path(ours["location"]).resolve().is_relative_to(venv.resolve()), ours["location"]  # installed, not the checkout
    ours_files = {f for f in ours["files"] if not f.split("/")[0].endswith(".dist-info")}
    assert "megatron/fsdp/__init__.py" in ours_files and "megatron/fsdp_training/__init__.py" in ours_files
    assert "megatron/__init__.py" not in ours_files  # a namespace package, shared with megatron-core
    overlap = sorted(ours_files & set(after["megatron-core"]["files"]))
    assert not overlap, f"installed by both {PROJECT} and megatron-core {after['megatron-core']['version']}: {overlap}"


def test_a_containers_pre_release_torch_is_kept(tmp_path):
    """An NGC container's torch reports a pre-release local version (``2.13.0a0+<git>.nv25.11``): the requirement
    accepts it, so the install leaves it alone (with ``torch>=2.13.0`` pip, offline here, finds nothing to satisfy it;
    online it would download another torch)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    ours_site = Path(_probe_site(python))
    container = "2.13.0a0+gitabc1234.nv25.11"
    info = ours_site / f"torch-{container}.dist-info"  # the venv's own site first: pip sees this torch
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {container}\n")
    (info / "RECORD").write_text("")
    (ours_site / "running_interpreter.pth").write_text("\n".join(_running_site_dirs()) + "\n")
    assert _probe(python, "torch")["torch"]["version"] == container
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                          "--no-build-isolation", "--no-compile", str(_sources(tmp_path / "src"))],
                         capture_output=True, text=True, env=_pip_env(), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    check = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "check"], capture_output=True,
                           text=True, env=_pip_env(), timeout=120)
    assert f"{PROJECT} 0.1.0 has requirement torch" not in check.stdout, check.stdout
    assert _probe(python, "torch")["torch"]["version"] == container
