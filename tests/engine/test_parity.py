"""Parity: every level and world size trains exactly like one unsharded process."""

import dataclasses

import pytest
import torch

from megatron.fsdp.testing.common import LEVELS, rel
from megatron.fsdp.testing.engine_training import RunConfig
from tests.cases.engine_shared import FP32_RTOL, assert_parity, reference, run
from tests.cases.level_matrix import covering


@pytest.mark.slow
# Every level on every world size; 1 and 3 micro-batches alternate so that each level and
# each world size meets both (MFSDP_FULL_MATRIX=1: all 32 combinations).
@pytest.mark.parametrize("strategy, world_size, micro_batches", covering(LEVELS, [1, 2, 3, 4], [1, 3], full=2))
def test_fp32_parity(pool, strategy, world_size, micro_batches):
    cfg = RunConfig(strategy=strategy, micro_batches=micro_batches)
    assert_parity(run(pool, cfg, world_size), reference(cfg), FP32_RTOL, 1e-5)


def test_world_size_one_is_bitwise_for_losses(pool):
    """One rank, no collectives: forward and backward are the reference's own ops."""
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=2, steps=1)
    result = run(pool, cfg, 1)
    assert result["losses"] == reference(cfg)["losses"]


@pytest.mark.parametrize("strategy", LEVELS)
def test_activation_recompute_parity(pool, strategy):
    cfg = RunConfig(strategy=strategy, micro_batches=2, recompute=True)
    assert_parity(run(pool, cfg, 3), reference(dataclasses.replace(cfg, recompute=False)), FP32_RTOL, 1e-5)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_other_elementwise_optimizers(pool, optimizer):
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=2, optimizer=optimizer)
    assert_parity(run(pool, cfg, 4), reference(cfg), FP32_RTOL, 1e-5)


def test_labelled_param_group_parity(pool):
    """A labelled group (the embedding at its own lr: Megatron-LM's --decoupled-lr) trains as torch's optimizer
    with the same groups; the engine keeps its groups' order and labels on every rank."""
    cfg = RunConfig(strategy="optim_grads_params", micro_batches=2, labelled_lr=1e-3)
    result = run(pool, cfg, 3)
    assert_parity(result, reference(cfg), FP32_RTOL, 1e-5)
    plain = reference(dataclasses.replace(cfg, labelled_lr=None))
    assert rel(result["losses"][-1], plain["losses"][-1]) > 1e-4  # the group's lr is used


@pytest.mark.parametrize("strategy", LEVELS)
def test_bf16_mixed_precision_parity(pool, strategy):
    """bf16 compute against the fp32 reference: equal within bf16 rounding."""
    cfg = RunConfig(strategy=strategy, micro_batches=2, bf16=True)
    ref = reference(dataclasses.replace(cfg, bf16=False))
    result = run(pool, cfg, 2)
    for name in ("losses", "grad_norms"):
        errs = [rel(a, b) for a, b in zip(result[name], ref[name])]
        assert max(errs) < 3e-2, f"{name}: {result[name]} vs {ref[name]}"
    diff = ref_norm = 0.0
    for name, expected in ref["params"].items():
        assert result["params"][name].dtype == torch.float32  # main weights stay fp32
        diff += (result["params"][name] - expected).pow(2).sum().item()
        ref_norm += expected.pow(2).sum().item()
    assert (diff / ref_norm) ** 0.5 < 1e-2, f"parameters drifted: relative L2 {(diff / ref_norm) ** 0.5:.2e}"
