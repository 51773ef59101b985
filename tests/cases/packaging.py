"""What the packaging tests share: a venv that sees the running interpreter's packages, pip without this
machine's configuration, a copy of the sources a wheel is built from, and a probe of installed distributions."""

import json
import os
import shutil
import site
import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
PROJECT = "megatron-fsdp-backend"
KEPT = ("torch", "megatron-core")

PROBE_SCRIPT = r"""
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


def probe(python: Path, *names: str) -> dict:
    out = subprocess.run([str(python), "-c", PROBE_SCRIPT, *names], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def running_site_dirs() -> list:
    dirs = site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def probe_site(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def pip_env() -> dict:
    """pip without this machine's configuration (its find-links, extra indexes, constraints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return dict(env, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")


def sources(into: Path) -> Path:
    """What a wheel is built from (a copy: the build leaves build/ and *.egg-info behind)."""
    into.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, into / name)
    shutil.copytree(ROOT / "megatron", into / "megatron", ignore=shutil.ignore_patterns("__pycache__", "core"))
    return into
