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

import subprocess
import sys
from pathlib import Path

from tests.cases.packaging import KEPT, PROJECT, pip_env, probe, probe_site, running_site_dirs, sources


def test_install_keeps_torch_and_megatron_core_and_ships_none_of_their_files(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    # the running interpreter's packages, after the venv's own (a .pth line is appended to sys.path)
    ours_site = probe_site(python)
    (Path(ours_site) / "running_interpreter.pth").write_text("\n".join(running_site_dirs()) + "\n")
    before = probe(python, *KEPT)
    assert all(before[name] for name in KEPT), before
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                          "--no-build-isolation", "--no-compile", str(sources(tmp_path / "src"))],
                         capture_output=True, text=True, env=pip_env(), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    after = probe(python, *KEPT, PROJECT)
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
    ours_site = Path(probe_site(python))
    container = "2.13.0a0+gitabc1234.nv25.11"
    info = ours_site / f"torch-{container}.dist-info"  # the venv's own site first: pip sees this torch
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {container}\n")
    (info / "RECORD").write_text("")
    (ours_site / "running_interpreter.pth").write_text("\n".join(running_site_dirs()) + "\n")
    assert probe(python, "torch")["torch"]["version"] == container
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                          "--no-build-isolation", "--no-compile", str(sources(tmp_path / "src"))],
                         capture_output=True, text=True, env=pip_env(), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    check = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "check"], capture_output=True,
                           text=True, env=pip_env(), timeout=120)
    assert f"{PROJECT} 0.1.0 has requirement torch" not in check.stdout, check.stdout
    assert probe(python, "torch")["torch"]["version"] == container
