"""Expert sections: parameters on their own mesh with their own level still train like one process.

The engine side of MoE support, without a token dispatcher: the MLPs'
up-projections form the expert section (so a unit holds a dense and an expert
part), with a level and mesh different from the dense layers'. Real expert
parallelism (Megatron-Core's dispatchers) is covered in tests/mcore/test_moe.py.
"""

import dataclasses

import pytest

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import GLOBAL_MICRO_BATCH, build_model, train_step, wrap
from megatron.fsdp.testing.engine_training import RunConfig
from megatron.fsdp.testing.models import Block, make_batches
from tests.cases.engine_shared import FP32_RTOL, assert_parity, reference, run


def expert_layout(ctx):
    """Dense ZeRO-3 with an expert section at ZeRO-1 on the same ranks: units, levels, ledger axes."""
    cfg = RunConfig(strategy="optim_grads_params", expert_strategy="optim", micro_batches=2, steps=1)
    fsdp, opt = wrap(ctx, cfg)
    for step in make_batches(cfg.steps, cfg.micro_batches, GLOBAL_MICRO_BATCH):
        train_step(ctx, fsdp, opt, step, cfg)
    experts = [u for u in fsdp.units if u.storage.section == "expert"]
    return {
        "expert_units": [u.name for u in experts],
        "expert_params": [n for u in experts for n in u.param_names],
        "levels": {name: str(s.levels) for name, s in fsdp.sections.items()},
        "expert_axes": sorted({axis for _kind, axis in fsdp.ledger.summary() if axis.startswith("expert")}),
    }


def expert_outside_unit(ctx):
    """An expert parameter in the root unit cannot be gathered with its layer: a clear error on every rank."""
    model = build_model(RunConfig())
    experts = mfsdp.ExpertSharding(lambda name, p: name.startswith("embed"), mfsdp.DataParallelMesh(ctx.group))
    try:
        mfsdp.fully_shard(model, unit_modules=(Block,), mesh=ctx.group, experts=experts)
    except ValueError as exc:
        return str(exc)
    return None


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
