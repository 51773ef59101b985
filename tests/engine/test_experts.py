"""Expert sections: parameters on their own mesh with their own level still train like one process.

The engine side of MoE support, without a token dispatcher: the MLPs'
up-projections form the expert section (so a unit holds a dense and an expert
part), with a level and mesh different from the dense layers'. Real expert
parallelism (Megatron-Core's dispatchers) is covered in tests/mcore/test_moe.py.
"""

import dataclasses

import pytest

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine import expert_layout, expert_outside_unit
from megatron.fsdp.testing.engine_training import RunConfig
from tests.cases.parity import FP32_RTOL, assert_parity, reference, run


REFERENCE = RunConfig(strategy="no_shard", micro_batches=3)

CASES = [
    # (dense level, expert level, expert mesh, expert outer level, sum-then-scale)
    ("optim_grads_params", "optim", None, None, False),
    ("no_shard", "optim_grads_params", None, None, True),
    ("optim_grads", "optim_grads_params", (2, 2), "no_shard", False),   # experts HSDP, dense flat
    ("optim_grads_params", "optim_grads_params", (2, 2), "optim", True),  # experts HFSDP
]


@pytest.mark.parametrize("dense, expert, mesh, outer, summed", CASES)
def test_expert_section_parity(pool, dense, expert, mesh, outer, summed):
    cfg = dataclasses.replace(REFERENCE, strategy=dense, expert_strategy=expert, expert_mesh=mesh,
                              expert_outer_strategy=outer, expert_sum_scaled=summed)
    assert_parity(run(pool, cfg, 4), reference(REFERENCE), FP32_RTOL, 1e-5)


def test_expert_units_and_ledger_axes(pool):
    result = pool.run(expert_layout, size=4)[0]
    assert result["expert_units"] == ["blocks.0.mlp[experts]", "blocks.1.mlp[experts]"]
    assert result["levels"] == {"dense": "optim_grads_params x no_shard", "expert": "optim x no_shard"}
    assert result["expert_axes"] == ["expert_dp_shard"]
    assert all("up." in n for n in result["expert_params"]) and result["expert_params"]


def test_expert_outside_units_is_rejected(pool):
    errors = pool.run(expert_outside_unit, size=2)
    assert all("not inside any unit module" in e for e in errors), errors


def test_expert_levels_are_validated():
    with pytest.raises(ValueError, match="needs an outer data-parallel axis"):
        mfsdp.fully_shard(
            __import__("torch").nn.Linear(2, 2),
            experts=mfsdp.ExpertSharding(lambda n, p: True, mfsdp.DataParallelMesh(None, None),
                                         strategy="optim", outer_strategy="optim_grads_params"))
