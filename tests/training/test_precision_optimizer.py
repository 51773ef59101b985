"""pretrain_gpt.py --use-precision-aware-optimizer: bf16 Adam moments and main grads, with Megatron-LM's flags.

Runs in the 2-rank gloo pool (no new processes): fp32-state training saved at iteration 2,
the same job with bf16 state (close to it within bf16 rounding), and the fp32-state checkpoint
loaded into bf16 state. (Exact resume of bf16 state: tests/engine/test_precision.py.)
"""

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp.testing.common import rel
from megatron.fsdp_training.testing.job import fsdp
from tests.cases.job_runs import B8, MODEL, pretrain


SHORT = ["--train-iters", "4", "--eval-interval", "2", "--bf16"] + fsdp("optim_grads_params")
LOW = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
       "--main-grads-dtype", "bf16"]


def test_bf16_state_trains_and_loads_fp32_state(tmp_path):
    argv = MODEL + B8 + SHORT
    fp32 = pretrain(2, argv + ["--save", str(tmp_path / "fp32"), "--save-interval", "2"])
    low = pretrain(2, argv + LOW)
    for key in ("losses", "grad_norms"):
        assert len(low[key]) == len(fp32[key]) == 4
        assert max(rel(a, b) for a, b in zip(low[key], fp32[key])) < 3e-2, (key, low[key], fp32[key])
    crossed = pretrain(2, argv + LOW + ["--load", str(tmp_path / "fp32"), "--ckpt-step", "2"])
    assert crossed["start_iteration"] == 2
    assert max(rel(a, b) for a, b in zip(crossed["losses"], fp32["losses"][2:])) < 3e-2


@pytest.mark.parametrize("argv, pattern", [
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"], "add --use-megatron-fsdp"),
    (["--use-precision-aware-optimizer", "--use-megatron-fsdp", "--optimizer", "sgd"], "only supports --optimizer adam"),
    (["--use-precision-aware-optimizer", "--use-megatron-fsdp", "--main-grads-dtype", "bf16"], "needs --bf16"),
])
def test_precision_aware_optimizer_argument_errors(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_bf16_main_grads_are_reduced_in_bf16():
    args = validate_args(parse_args(["--mock-data", "--bf16", "--use-megatron-fsdp"] + LOW), 2)
    assert args.grad_reduce_in_fp32 is False
