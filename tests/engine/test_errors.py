"""Bad input fails with a message that names the fix, before any collective can hang."""

import pytest
import torch

import megatron.fsdp as mfsdp
from megatron.fsdp.testing import engine as cases
from tests.cases.engine_failures import collective_on_one_rank, replicas_built_differently


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
    messages = pool.run(cases.error_before_collective, size=3, timeout=HANG_TIMEOUT, case=case)
    for message in messages:
        assert message is not None, f"{case}: nothing was raised"
        assert __import__("re").search(pattern, message), message


def test_modules_that_differ_across_ranks_are_named(pool):
    messages = pool.run(cases.mismatched_models, size=3, timeout=HANG_TIMEOUT)
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

    from megatron.fsdp.testing.models import Block, TinyLM

    model = mfsdp.fully_shard(TinyLM(), unit_modules=(Block,))
    sd = model.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert all(torch.equal(back[k].full_tensor(), v.full_tensor()) for k, v in sd.items() if hasattr(v, "full_tensor"))
