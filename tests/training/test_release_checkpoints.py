"""A checkpoint saved under one Megatron-Core release resumes under another, bitwise at the same layout.

``tests/data/release_checkpoints_mcore_<version>.tar.xz`` (one per supported release, written by
``tools/checkpoint/release_fixture.py`` under it; tests/data/README.md): ``fsdp_dtensor`` and
``torch_dist`` checkpoints of a tiny GPT at iteration 2 on 2 ranks, and the losses, grad norms and
validation losses the saving release got resuming them to iteration 4 (on the machine that wrote
them). Both fixtures hold the same run. This suite resumes each under the installed release, on this
machine, and the two must continue bit for bit alike: the other release's checkpoint exactly as its own,
which holds only if nothing a checkpoint holds (keys, the common state's file, optimizer layout, RNG
state) depends on the release. Against the manifest's numbers, from another machine whose CPU kernels
may round differently (an AMD EPYC's and an Intel Xeon's AMX grad norms differ in the 8th digit), each
resume agrees within ``MACHINE_RTOL``.
"""

from pathlib import Path

import pytest

from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.testing.job import ROOT
from megatron.fsdp_training.testing.release_fixture import AT, FORMATS, ITERATIONS, fixture_name, resume_fixture

DATA = Path(ROOT) / "tests" / "data"
RELEASES = ("0.16.1", "0.19.2")  # the supported releases the suite runs on (docs/training.md, "Which Megatron-Core")
MACHINE_RTOL = 1e-6  # the manifest's numbers against this machine's: the same computation, other CPU kernels


def _as_list(value):
    """A manifest entry as a list of numbers (a history, or one value such as ``valid_at_load``)."""
    return value if isinstance(value, list) else [value]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each release's fixture resumed here, under the installed release (once for the module)."""
    return {version: resume_fixture(DATA / fixture_name(version), tmp_path_factory.mktemp(version))
            for version in RELEASES}


def test_a_fixture_per_release():
    """Both releases' fixtures are there (so each suite loads the other's), each of a few hundred KB at most."""
    for version in RELEASES:
        path = DATA / fixture_name(version)
        assert path.is_file(), f"{path}: write it with tools/checkpoint/release_fixture.py under {version}"
        assert path.stat().st_size < 300_000, path


@pytest.mark.parametrize("version", RELEASES)
def test_release_checkpoint_resumes_as_the_saving_release_did(resumed, version):
    result = resumed[version]
    assert result["manifest"]["megatron_core"] == version and set(result["manifest"]["formats"]) == set(FORMATS)
    for fmt in FORMATS:
        expected, got = result[fmt]["expected"], result[fmt]["got"]
        assert expected["start_iteration"] == AT and len(expected["losses"]) == ITERATIONS - AT, (fmt, expected)
        assert got.keys() == expected.keys() and got["start_iteration"] == AT, (fmt, got)
        for key in (k for k in expected if k != "start_iteration"):
            ours, theirs = _as_list(got[key]), _as_list(expected[key])
            assert len(ours) == len(theirs) and all(rel(a, b) <= MACHINE_RTOL for a, b in zip(ours, theirs)), \
                (fmt, version, key, got[key], expected[key])


def test_both_releases_checkpoints_resume_bitwise_alike(resumed):
    """The same run saved by each release continues here bit for bit alike, whichever release saved it."""
    for fmt in FORMATS:
        assert resumed[RELEASES[0]][fmt]["got"] == resumed[RELEASES[1]][fmt]["got"], fmt


def test_grouped_gemm_experts_across_releases_are_refused_with_the_release_to_use():
    """``--moe-grouped-gemm`` experts are GroupedMLP's ``weight1``/``weight2`` under 0.16.1 and one weight per expert
    from 0.17: a checkpoint of the other kind stops the load naming the release that reads it (any other key
    mismatch gets no such sentence)."""
    from megatron.fsdp.mcore_releases import expert_layout_hint

    grouped = ["model.decoder.layers.0.mlp.experts.weight1", "model.decoder.layers.0.mlp.experts.weight2"]
    per_expert = [f"model.decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(2)]
    assert "resume this checkpoint under megatron-core 0.16.1" in expert_layout_hint(per_expert, grouped)
    assert "resume this checkpoint under megatron-core 0.17 or later" in expert_layout_hint(grouped, per_expert)
    assert expert_layout_hint(["model.output_layer.weight"], ["model.decoder.final_layernorm.weight"]) == ""
