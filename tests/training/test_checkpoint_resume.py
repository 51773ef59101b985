"""Exact resume of pretrain_gpt.py's checkpoints (--save/--load, --ckpt-format fsdp_dtensor): a run that loads
iteration 5 continues the run that never stopped bitwise (losses, grad norms, validation) on 2 ranks and at TP 2 x
DP 2 with --async-save and --exit-interval; --no-load-optim, --finetune, the random generators' round trip, the
optimizer state another trainer's load keeps, and the save and load flags' errors.

Resharding to other layouts: test_checkpoint_resharding.py; kills and failures during a save:
test_checkpoint_crash_safety.py; checkpoint keys and layouts: test_checkpoint_keys.py.
"""

from typing import Dict, List

import pytest
import torch

from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.checkpointing import files
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.testing.megatron_case import megatron_case
from megatron.fsdp_training.testing.pools import pool_of
from megatron.fsdp_training.tools.checkpoint_tools import inspect as ckpt_inspect
from tests.cases.job_runs import B8, MODEL, assert_exact_resume, causal_inputs, pretrain, same_values
from tests.cases.level_matrix import full_matrix


def rng_round_trip(ctx, argv: List[str], directory: str) -> Dict[str, bool]:
    """Draws after a load equal the draws after the save, for every generator a checkpoint restores."""
    import random

    import numpy as np

    from megatron.core import tensor_parallel
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.checkpointing.checkpoint_config import CheckpointConfig
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    def draws():
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tracked = torch.rand(2)
        return {"torch": torch.rand(3), "python": random.random(), "numpy": float(np.random.rand()),
                "tracker": tracked}

    args = parse_args(argv + ["--save", directory, "--load", directory])
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        checkpoint = CheckpointConfig.from_args(args)
        draws()  # move every generator away from its seed
        checkpointing.save_checkpoint(checkpoint, 1, args.global_batch_size, model, optimizer, scheduler)
        expected = draws()
        draws()
        iteration, consumed = checkpointing.load_checkpoint(checkpoint, model, optimizer, scheduler)
        got = draws()
        same = {k: bool(torch.equal(v, got[k])) if isinstance(v, torch.Tensor) else v == got[k]
                for k, v in expected.items()}
        return {**same, "position": (iteration, consumed) == (1, args.global_batch_size)}


def _adam_state(optimizer) -> Dict[str, torch.Tensor]:
    """Every optimizer state tensor of this rank (moments, step, initialised flag), as local copies."""
    out = {}
    for k, v in optimizer.state_dict().items():
        local = v._local_tensor if hasattr(v, "_local_tensor") else v
        if isinstance(local, torch.Tensor):
            out[k] = local.clone()
    return out


def trainer_preload_copy(ctx, argv: List[str], directory: str) -> Dict[str, object]:
    """Megatron-LM's and Bridge's ``fsdp_dtensor`` round trip: save ``optimizer.sharded_state_dict``; at load, keep
    a shallow copy of the optimizer and model dicts from before ``dcp.load`` and hand those copies to
    ``load_state_dict`` (only what ``dcp.load`` filled in place survives). Returns the keys whose loaded state
    differs from the saved one (every Adam moment, the step, the flag) and whether any were compared."""
    import torch.distributed.checkpoint as dcp

    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    metadata = {"distrib_optim_sharding_type": "fsdp_dtensor"}
    with megatron_case():
        _, _, model, optimizer, _ = setup(args)
        tokens, positions, mask = causal_inputs(args.padded_vocab_size, args.seq_length)
        for _ in range(2):
            model[0](tokens, positions, mask, labels=tokens).float().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = _adam_state(optimizer)
        dcp.save({"model": model[0].state_dict_for_save_checkpoint(),
                  "optimizer": optimizer.sharded_state_dict({}, metadata=metadata)}, checkpoint_id=directory)
    with megatron_case():
        _, _, model, optimizer, _ = setup(args)  # fresh: no Adam state yet, as a trainer's load finds it
        state = {"model": model[0].state_dict_for_save_checkpoint(),
                 "optimizer": optimizer.sharded_state_dict({}, is_loading=True, metadata=metadata)}
        raw_model, raw_optimizer = state["model"].copy(), state["optimizer"].copy()
        dcp.load(state, checkpoint_id=directory)
        model[0].load_state_dict(raw_model)
        optimizer.load_state_dict(raw_optimizer)
        loaded = _adam_state(optimizer)
        differ = sorted(k for k in saved if k not in loaded or not same_values(saved[k], loaded[k]))
        return {"differ": differ, "compared": sorted(saved), "initialized": bool(loaded.get("state_initialized"))}


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ZeRO-1 and ZeRO-3 here; ZeRO-2 resumes bitwise through pretrain in the TP 2 test below, no_shard
# and ZeRO-2 load in test_checkpoint_resharding.py, and every level resumes bitwise in tests/engine/test_checkpoint.py
# (MFSDP_FULL_MATRIX=1: all four levels here).
@pytest.mark.parametrize("level", [pytest.param(lv, marks=pytest.mark.slow)
                                   for lv in (LEVELS[:3] if full_matrix() else ["optim"])] + [LEVELS[3]])
def test_exact_resume_2_ranks(tmp_path, level):
    """10 iterations (saving at 5 and 10) against a fresh run that loads iteration 5: bitwise equal."""
    argv = MODEL + B8 + fsdp(level)
    straight = pretrain(2, argv + ["--save", str(tmp_path), "--save-interval", "5"])
    assert files.read_tracker(tmp_path) == 10 and _leftovers(tmp_path) == []
    resumed = pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5"])
    assert_exact_resume(straight, resumed, 5)


def test_exact_resume_tp2_dp2_with_async_saves_and_exit_interval(tmp_path):
    """TP 2 x DP 2 at ZeRO-2: a run that never saved, against --async-save every 2 iterations with
    --exit-interval 5 (waits for the write in flight, stops), then --load: all bitwise."""
    argv = MODEL + B8 + fsdp("optim_grads") + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    straight = pretrain(4, argv)
    first = pretrain(4, argv + ["--save", str(tmp_path), "--save-interval", "2", "--exit-interval", "5",
                                 "--async-save"])
    assert first["losses"] == straight["losses"][:5] and first["grad_norms"] == straight["grad_norms"][:5]
    assert files.read_tracker(tmp_path) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000005",
                                                          files.TRACKER]
    resumed = pretrain(4, argv + ["--load", str(tmp_path), "--save", str(tmp_path), "--async-save"])
    assert_exact_resume(straight, resumed, 5)
    assert files.read_tracker(tmp_path) == 10  # the end of training saves
    keys = ckpt_inspect.describe(tmp_path / "iter_0000010")["keys"]
    assert not any(k.split(".")[1].startswith("tp") for k in keys)  # TP-global keys and shapes
    assert keys["model.decoder.layers.0.mlp.linear_fc1.weight"]["shape"] == [256, 64]


def test_no_load_optim_and_finetune(tmp_path):
    argv = MODEL + B8 + fsdp("optim_grads_params")
    straight = pretrain(2, argv + ["--save", str(tmp_path), "--save-interval", "5"])
    fresh_optim = pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5", "--no-load-optim"])
    # The loss and gradient of iteration 6 depend on the weights only; its update on the optimizer.
    assert fresh_optim["start_iteration"] == 5
    assert fresh_optim["losses"][0] == straight["losses"][5] and fresh_optim["grad_norms"][0] == straight["grad_norms"][5]
    assert fresh_optim["losses"][1] != straight["losses"][6]
    tuned = pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5", "--finetune", "--train-iters", "3"])
    assert tuned["start_iteration"] == 0 and len(tuned["losses"]) == 3 and tuned["valid_at_load"] is None


def test_rng_states_round_trip(tmp_path):
    result = pool_of(2).run(rng_round_trip, timeout=300,
                             argv=MODEL + B8 + fsdp("optim"), directory=str(tmp_path))
    assert all(all(r.values()) for r in result), result


@pytest.mark.parametrize("argv, pattern", [
    (["--save", "x", "--ckpt-format", "fsdp_dtensor"], "fsdp_dtensor needs --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--load", "x", "--ckpt-format", "torch"], "not implemented: use --ckpt-format fsdp_dtensor"),
    (["--save-interval", "5"], "needs --save DIR"),
    (["--finetune"], "--finetune needs --load"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
    (["--exit-interval", "0"], "must be at least 1"),
])
def test_checkpoint_argument_errors(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_a_trainers_pre_load_copy_keeps_every_adam_moment(tmp_path):
    """Megatron-LM's and Bridge's fsdp_dtensor load put back their copy of the optimizer dict from before
    ``dcp.load``: everything checkpointed is a tensor filled in place, so no moment, step or flag is lost (ZeRO-3:
    each rank's pieces of every parameter)."""
    results = pool_of(2).run(trainer_preload_copy, timeout=300, argv=MODEL + B8 + fsdp("optim_grads_params"),
                             directory=str(tmp_path / "ckpt"))
    for result in results:
        assert result["differ"] == [] and result["initialized"], result
        assert any(k.endswith(".exp_avg_sq") for k in result["compared"]), result["compared"]
        assert "state_initialized" in result["compared"]
