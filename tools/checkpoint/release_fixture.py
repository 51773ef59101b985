"""Write the installed Megatron-Core release's cross-release checkpoint fixture (tests/data/).

    python tools/checkpoint/release_fixture.py tests/data          # Python 3.11, megatron-core 0.16.1
    .venv312/bin/python tools/checkpoint/release_fixture.py tests/data   # Python 3.12, megatron-core 0.19.2

writes ``tests/data/release_checkpoints_mcore_<version>.tar.xz``: a tiny GPT saved at iteration 2
in ``fsdp_dtensor`` (``--use-megatron-fsdp`` ZeRO-3) and ``torch_dist`` (Megatron-Core's DDP), 2 CPU
ranks, with the losses, grad norms and validation losses this release got resuming each to
iteration 4 (``megatron/fsdp_training/testing/release_fixture.py``).
``tests/training/test_release_checkpoints.py`` resumes every such file under the release the suite
runs on and requires those numbers bitwise. Run from the repository root (about a minute).
"""

import os
import sys

# Run as a script, this file's directory would come first on sys.path, and its
# sibling inspect.py would shadow the standard library's ``inspect``.
if __name__ == "__main__":
    _HERE = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

import argparse  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where the fixture goes (tests/data)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron.fsdp.mcore_releases import MCORE_VERSION_STRING
    from megatron.fsdp_training.testing import pools
    from megatron.fsdp_training.testing.release_fixture import fixture_name, write_fixture

    out = os.path.join(args.directory, fixture_name(MCORE_VERSION_STRING))
    try:
        manifest = write_fixture(out)
    finally:
        pools.close_all()
    for fmt, resumed in manifest["formats"].items():
        print(f"{fmt}: resumed at iteration {resumed['start_iteration']}, losses {resumed['losses']}")
    print(f"wrote {out} ({os.path.getsize(out)} bytes, megatron-core {manifest['megatron_core']}, "
          f"torch {manifest['torch']}, Python {manifest['python']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
