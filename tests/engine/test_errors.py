"""Bad input fails with a message that names the fix, before any collective can hang."""

from __future__ import annotations

import pytest
import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing.engine_training import RunConfig, build_model
from megatron.fsdp.testing.models import Block, TinyLM, make_batches


def mismatched_models(ctx):
    """Rank 1 builds a wider MLP: every rank must raise the same error, and nobody hangs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8 if ctx.rank != 1 else 9), torch.nn.Linear(8 if ctx.rank != 1 else 9, 4))
    try:
        mfsdp.fully_shard(model, strategy="optim_grads_params", mesh=ctx.group)
    except ValueError as exc:
        return str(exc)
    return None


def error_before_collective(ctx, case: str):
    """Errors that every rank detects locally; returns the message (None if nothing was raised)."""
    model = build_model(RunConfig())
    try:
        if case == "strategy":
            mfsdp.fully_shard(model, strategy="zero3", unit_modules=(Block,), mesh=ctx.group)
        elif case == "units":
            mfsdp.fully_shard(model, unit_modules=(torch.nn.GRU,), mesh=ctx.group)
        elif case == "step_without_backward":
            fsdp = mfsdp.fully_shard(model, unit_modules=(Block,), mesh=ctx.group)
            opt = mfsdp.FullyShardedOptimizer(fsdp, torch.optim.AdamW, lr=1e-3)
            opt.step()
        elif case == "grad_outside_unit":
            fsdp = mfsdp.fully_shard(model, strategy="optim_grads", unit_modules=(Block,), mesh=ctx.group)
            x = torch.randn(2, 8, 32)
            torch.nn.functional.linear(x, fsdp.module.blocks[0].mlp.up.weight).sum().backward()  # no module call
        else:
            raise AssertionError(case)
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def replicas_built_differently(ctx, strategy: str, steps: int = 3):
    """Each rank builds the model with its own seed; after the wrap and after training, all equal rank 0's."""
    torch.manual_seed(ctx.rank)
    module = TinyLM()
    with torch.no_grad():
        module.frozen_scale.fill_(1.0 + ctx.rank)  # a frozen parameter: no step would ever fix it
    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in TinyLM().state_dict().items()}
    model = mfsdp.fully_shard(module, strategy=strategy, mesh=ctx.group, unit_modules=(Block,))
    at_wrap = model.full_state_dict()
    optimizer = mfsdp.FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in make_batches(steps, 1, 2 * ctx.size):
        tokens, targets = step[0]
        n = tokens.shape[0] // ctx.size
        model(tokens[ctx.rank * n:(ctx.rank + 1) * n], targets[ctx.rank * n:(ctx.rank + 1) * n]).backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = model.full_state_dict()
    return {
        "wrap_equals_rank0_build": all(torch.equal(at_wrap[k], reference[k]) for k in at_wrap if k in reference),
        "trained": {k: v for k, v in trained.items() if k != "causal_offset"},
        "broadcasts": model.ledger.calls("broadcast"),
    }


def collective_on_one_rank(ctx, timeout_s: float = 3.0):
    """Rank 0 alone calls ``full_state_dict`` (a collective under ZeRO-3): it must fail naming the call, not hang."""
    import datetime

    import torch.distributed as dist

    group = dist.new_group(list(range(ctx.size)), timeout=datetime.timedelta(seconds=timeout_s))
    try:
        model = mfsdp.fully_shard(TinyLM(), strategy="optim_grads_params", mesh=group, unit_modules=(Block,))
        if ctx.rank != 0:
            return None
        try:
            model.full_state_dict()
        except mfsdp.CollectiveError as exc:
            return str(exc)
        return "nothing raised"
    finally:
        dist.destroy_process_group(group)


HANG_TIMEOUT = 60


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ValueError, match="no_shard.*optim.*optim_grads.*optim_grads_params"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), strategy="zero3")


@pytest.mark.parametrize("case, pattern", [
    ("strategy", r"ValueError: unknown sharding strategy 'zero3'; valid strategies are 'no_shard'"),
    ("units", r"ValueError: unit_modules \['GRU'\] matched no submodule of TinyLM; module classes present: .*Block"),
    ("step_without_backward", r"RuntimeError: optimizer.step\(\) called without a backward pass"),
    ("grad_outside_unit", r"RuntimeError: .*received a gradient outside that unit's backward"),
])
def test_errors_raise_on_every_rank_without_hanging(pool, case, pattern):
    messages = pool.run(error_before_collective, size=3, timeout=HANG_TIMEOUT, case=case)
    for message in messages:
        assert message is not None, f"{case}: nothing was raised"
        assert __import__("re").search(pattern, message), message


def test_modules_that_differ_across_ranks_are_named(pool):
    messages = pool.run(mismatched_models, size=3, timeout=HANG_TIMEOUT)
    for message in messages:
        assert message is not None
        assert "differs across data-parallel ranks" in message
        assert "'0.weight'" in message and "(8, 8) vs (9, 8)" in message, message


def test_mixed_dtypes_in_one_unit_need_a_policy():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(TypeError, match="mixes compute dtypes"):
        mfsdp.fully_shard(module)
    mfsdp.fully_shard(module, mixed_precision=mfsdp.MixedPrecision(param_dtype=torch.float32))


def test_rewrapping_is_rejected():
    model = mfsdp.fully_shard(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already wrapped"):
        mfsdp.fully_shard(model)


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_replicas_built_with_different_seeds_become_rank0s(pool, strategy):
    """DDP's rule. A rank-dependent build is refused, not trained as diverging replicas."""
    results = pool.run(replicas_built_differently, size=2, timeout=HANG_TIMEOUT,
                       strategy=strategy)
    for r in results:
        assert r["wrap_equals_rank0_build"] and r["broadcasts"] > 0, r
    for name, value in results[0]["trained"].items():
        assert torch.equal(value, results[1]["trained"][name]), name


def test_collective_called_on_one_rank_names_itself_instead_of_hanging():
    """``full_state_dict`` on rank 0 alone raises, naming the collective, instead of waiting gloo's 30 minutes."""
    from megatron.fsdp_training.testing.pools import pool_of

    message = pool_of(2).run(collective_on_one_rank, timeout=HANG_TIMEOUT)[0]
    assert message.startswith("full_state_dict is a collective: every rank of dp_shard must call it; "
                              "all_reduce on axis dp_shard (purpose: state_dict) did not complete"), message


def test_state_dict_pieces_pickle():
    """torch.save(model.state_dict()) works."""
    import io

    model = mfsdp.fully_shard(TinyLM(), unit_modules=(Block,))
    sd = model.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert all(torch.equal(back[k].full_tensor(), v.full_tensor()) for k, v in sd.items() if hasattr(v, "full_tensor"))
