"""DCP checkpoints: exact resume at every level, resharding across world sizes, levels and meshes, errors."""

import math
import random

import pytest
import torch

from megatron.fsdp.checkpoint.pieces import flat_boxes
from megatron.fsdp.testing.common import LEVELS, rel
from tests.cases import engine_checkpoint as cases
from tests.cases.engine_checkpoint import assert_exact_resume


def test_flat_boxes_tile_any_range():
    """Boxes of a flat range are that range, in order, each one contiguous; at most 2 * ndim - 1 of them."""
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        hi = rng.randint(lo, n)
        ref = torch.arange(n).view(shape)
        pos = lo
        boxes = flat_boxes(shape, lo, hi)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        for box in boxes:
            block = ref[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].reshape(-1)
            assert box.start == pos and torch.equal(block, torch.arange(pos, pos + box.numel))
            pos += box.numel
        assert pos == max(lo, hi)


def _run(pool, target, size, **kwargs):
    return pool.run(getattr(cases, target), size=size, timeout=300, **kwargs)


def test_exact_resume_zero3(pool, tmp_path):
    for result in _run(pool, "resume_exact", 2, strategy="optim_grads_params", path=str(tmp_path)):
        assert_exact_resume(result)


MESHES = {  # exact resume beyond a flat mesh: (ranks, RunConfig fields)
    "2x2-hfsdp": (4, dict(strategy="optim_grads_params", mesh=(2, 2), outer_strategy="optim")),
    "2x2-optim-optim": (4, dict(strategy="optim", mesh=(2, 2), outer_strategy="optim")),
    "experts-zero1-in-zero3": (2, dict(strategy="optim_grads_params", expert_strategy="optim")),
    "experts-hsdp-in-zero2": (4, dict(strategy="optim_grads", expert_strategy="optim_grads_params",
                                      expert_mesh=(2, 2), expert_outer_strategy="no_shard")),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", LEVELS[:3])
def test_exact_resume_every_level(pool, tmp_path, strategy):
    for result in _run(pool, "resume_exact", 2, strategy=strategy, path=str(tmp_path)):
        assert_exact_resume(result)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MESHES))
def test_exact_resume_meshes_and_expert_sections(pool, tmp_path, name):
    size, config = MESHES[name]
    for result in _run(pool, "resume_exact", size, path=str(tmp_path), **config):
        assert_exact_resume(result)


def test_exact_resume_through_stateful_objects(pool, tmp_path):
    """``dcp.save({"model": fsdp, "optim": opt})`` calls the state_dict/load_state_dict methods itself."""
    for result in _run(pool, "resume_exact", 2, strategy="optim", path=str(tmp_path), stateful=True):
        assert_exact_resume(result)


def test_bf16_round_trip_keeps_fp32_main_weights(pool, tmp_path):
    for strategy in ("optim", "optim_grads_params"):
        for result in _run(pool, "resume_exact", 2, strategy=strategy, path=str(tmp_path / strategy), bf16=True):
            assert_exact_resume(result)
            assert result["main_dtypes"] == ["torch.float32"]


def test_optimizer_saved_before_first_step_loads_as_fresh(pool, tmp_path):
    result = _run(pool, "fresh_optimizer_round_trip", 2, path=str(tmp_path))[0]
    assert result["resumed"] == result["straight"]


RESHARD_TARGETS = [
    dict(size=2, strategy="optim"),
    dict(size=3, strategy="optim_grads"),
    dict(size=1, strategy="no_shard"),
    dict(size=4, strategy="optim_grads_params", mesh=(2, 2), outer_strategy="no_shard"),
    dict(size=4, strategy="optim_grads", expert_strategy="optim_grads_params", expert_mesh=(2, 2),
         expert_outer_strategy="no_shard"),
]


_SOURCE = {}


@pytest.fixture
def zero3_checkpoint(pool, tmp_path_factory):
    """Two ZeRO-3 steps on four ranks, saved; and the two steps after it from the run that never stopped.

    Made once per session (the pool fixture is per test, so the cache is by hand).
    """
    if "zero3" not in _SOURCE:
        path = str(tmp_path_factory.mktemp("zero3x4"))
        _SOURCE["zero3"] = path, _run(pool, "save_then_continue", 4, path=path)[0]
    return _SOURCE["zero3"]


def _check_reshard(pool, zero3_checkpoint, target):
    path, source = zero3_checkpoint
    result = _run(pool, "load_and_continue", path=path, **target)[0]
    for name, saved in source["params"].items():
        assert torch.equal(result["params"][name], saved), name
    for (loss, norm), (ref_loss, ref_norm) in zip(result["after"], source["after"]):
        assert rel(loss, ref_loss) <= 1e-5 and rel(norm, ref_norm) <= 1e-5, (result["after"], source["after"])


def test_reshard_zero3_to_two_ranks_optim(pool, zero3_checkpoint):
    _check_reshard(pool, zero3_checkpoint, RESHARD_TARGETS[0])


@pytest.mark.slow
@pytest.mark.parametrize("target", RESHARD_TARGETS[1:], ids=["3-optim_grads", "1-no_shard", "2x2-hsdp", "experts-2x2-hsdp"])
def test_reshard_zero3_to_other_meshes(pool, zero3_checkpoint, target):
    _check_reshard(pool, zero3_checkpoint, target)


def test_load_errors_name_the_keys_and_change_nothing(pool, tmp_path):
    out, other = _run(pool, "load_errors", 2, path=str(tmp_path))
    assert "another rank" in out["one_rank_only"] and "missing keys: norm.bias" in other["one_rank_only"]
    assert out["model_unchanged"] and out["optim_unchanged"]
    assert "missing keys: norm.bias" in out["model_missing"]
    assert "unexpected keys: bogus.weight" in out["model_unexpected"]
    assert "mismatched keys: pos" in out["model_shape"]
    assert "missing keys: state.pos.exp_avg" in out["optim_missing"]
    assert "mismatched keys:" in out["ckpt_shape"] and "model.embed.weight" in out["ckpt_shape"]
    message = out["ckpt_missing_unexpected"]
    assert "missing keys: model.extra.weight" in message and "unexpected keys: model.norm.bias" in message
    assert "unexpected keys: optim." in out["ckpt_model_only"]
    assert out["ckpt_model_only_allowed"] is None
