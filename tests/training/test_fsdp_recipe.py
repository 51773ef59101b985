"""The Megatron-FSDP user guide's flags as written: its five required and five recommended flags train on
4 ranks; --grad-reduce-in-bf16 halves the reduce-scatter bytes and matches Megatron-Core DDP with the same
flag within bf16's tolerance; --fsdp-double-buffer is bitwise the run without it; the start-up rules."""

from __future__ import annotations

from typing import List

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.arguments.substitutions import substitution_line
from megatron.fsdp_training.testing.job import PRETRAIN_MODEL
from megatron.fsdp_training.testing.pools import pool_of


def pretrain_with_ledger(ctx, argv: List[str]) -> dict:
    """Rank 0's history and log, plus the engine's ledger (reduce-scatter and all-gather bytes of the
    whole run, summed over model chunks) and the dtypes its gradients travel and accumulate in.

    The wrappers are taken from ``model.wrap_and_optimize`` as the job builds them; Megatron-Core's
    DDP has no ledger (``None``).
    """
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.testing.pretrain import pretrain_in_pool

    built = []
    original = model_lib.wrap_and_optimize

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        built.append(out[0])
        return out

    model_lib.wrap_and_optimize = capture
    try:
        history = pretrain_in_pool(ctx, argv, capture_log=True)
    finally:
        model_lib.wrap_and_optimize = original
    chunks = [chunk.fsdp for chunk in built[-1] if hasattr(chunk, "fsdp")]
    if not chunks:
        return dict(history, reduce_scatter_bytes=None)
    storages = [unit.storage for fsdp in chunks for unit in fsdp.units if unit.storage.trainable_params]
    return dict(history,
                reduce_scatter_bytes=sum(f.ledger.bytes("reduce_scatter") for f in chunks),
                reduce_scatter_calls=sum(f.ledger.calls("reduce_scatter") for f in chunks),
                reduce_dtypes=sorted({str(s.reduce_dtype) for s in storages}),
                main_grad_dtypes=sorted({str(s.main_grad.dtype) for s in storages}),
                gather_buffers=sum(1 for s in storages if s.gather_buffer is not None))

REQUIRED = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--no-gradient-accumulation-fusion", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
RECOMMENDED = ["--calculate-per-token-loss", "--init-model-with-meta-device", "--grad-reduce-in-bf16",
               "--fsdp-double-buffer", "--use-nccl-ub"]
SHORT = PRETRAIN_MODEL + ["--bf16", "--train-iters", "3", "--eval-interval", "3"]
BF16_RTOL = 2 ** -8  # bf16's rounding unit; measured: losses within 9e-6, grad norms within 1.4e-4


def _run(argv):
    return pool_of(4).run(pretrain_with_ledger, timeout=300, argv=argv)[0]


def _without(flag):
    return [f for f in REQUIRED + RECOMMENDED if f != flag]


@pytest.fixture(scope="module")
def guide():
    return _run(SHORT + REQUIRED + RECOMMENDED)


def test_the_user_guides_ten_flags_train_on_4_ranks(guide):
    assert len(guide["losses"]) == 3 and guide["losses"][-1] < guide["losses"][0]
    assert "levels optim_grads_params (dp_shard)" in guide["log"]
    assert "> substituted on this machine: --use-nccl-ub -> no effect (gloo has no NCCL user buffers to register)" \
        in guide["log"].splitlines()
    assert guide["reduce_dtypes"] == ["torch.bfloat16"] and guide["main_grad_dtypes"] == ["torch.float32"]
    assert guide["gather_buffers"] > 0


def test_grad_reduce_in_bf16_halves_the_reduce_scatter_bytes_and_matches_megatron_ddp(guide):
    fp32 = _run(SHORT + _without("--grad-reduce-in-bf16"))
    assert fp32["reduce_dtypes"] == ["torch.float32"] and fp32["main_grad_dtypes"] == ["torch.float32"]
    assert guide["reduce_scatter_calls"] == fp32["reduce_scatter_calls"] > 0
    assert 2 * guide["reduce_scatter_bytes"] == fp32["reduce_scatter_bytes"]
    ddp = _run(SHORT + ["--use-distributed-optimizer", "--calculate-per-token-loss", "--grad-reduce-in-bf16",
                        "--no-gradient-accumulation-fusion"])
    assert ddp["reduce_scatter_bytes"] is None  # Megatron-Core's own DistributedOptimizer
    for i, (ours, theirs) in enumerate(zip(guide["losses"] + guide["grad_norms"], ddp["losses"] + ddp["grad_norms"])):
        assert abs(ours - theirs) <= BF16_RTOL * abs(theirs), (i, ours, theirs)


def test_fsdp_double_buffer_is_bitwise_the_run_without_it(guide):
    plain = _run(SHORT + _without("--fsdp-double-buffer"))
    assert plain["gather_buffers"] == 0
    assert plain["losses"] == guide["losses"] and plain["grad_norms"] == guide["grad_norms"]
    assert plain["valid"] == guide["valid"]


@pytest.mark.parametrize("argv, pattern", [
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--fsdp-double-buffer"], "--fsdp-double-buffer keeps persistent buffers .* needs --use-megatron-fsdp"),
    (["--fsdp-double-buffer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
     "needs --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"),
    (["--megatron-fsdp-grad-comm-dtype", "bf16"], "configure Megatron-FSDP: add --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--bf16", "--megatron-fsdp-main-grads-dtype", "fp16"], "fp16: this job trains"),
    (["--use-megatron-fsdp", "--megatron-fsdp-grad-comm-dtype", "bf16"], "--grad-reduce-in-bf16 needs --bf16"),
])
def test_startup_rules(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data"] + argv), 2)


def test_defaults_and_what_is_said_at_start_up():
    args = validate_args(parse_args(["--mock-data"]), 2)
    assert (args.gradient_accumulation_fusion, args.grad_reduce_in_bf16, args.fsdp_double_buffer, args.nccl_ub) \
        == (True, False, False, False)
    assert args.grad_reduce_in_fp32 is True and args.use_distributed_optimizer is False
    # no fused kernel on this machine: the default's substitution is said, and the flag silences it
    assert "gradient accumulation fusion (Megatron-LM's default) -> unfused accumulation" in substitution_line(args)
    quiet = validate_args(parse_args(["--mock-data", "--no-gradient-accumulation-fusion"]), 2)
    assert substitution_line(quiet) == ""
    both = validate_args(parse_args(["--mock-data", "--use-megatron-fsdp", "--use-distributed-optimizer"]), 2)
    assert both.use_distributed_optimizer and both.data_parallel_sharding_strategy == "optim_grads_params"


def test_the_newer_dtype_spellings_are_the_flags_they_replace():
    """The DeepSeek-V3 script's newest version: --megatron-fsdp-grad-comm-dtype bf16 is --grad-reduce-in-bf16,
    --megatron-fsdp-main-grads-dtype bf16 is --use-precision-aware-optimizer --main-grads-dtype bf16."""
    base = ["--mock-data", "--bf16", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    fields = ("grad_reduce_in_bf16", "grad_reduce_in_fp32", "use_precision_aware_optimizer", "main_grads_dtype",
              "exp_avg_dtype", "exp_avg_sq_dtype")

    def settings(extra):
        args = validate_args(parse_args(base + extra), 2)
        return tuple(getattr(args, f) for f in fields)

    assert settings(["--megatron-fsdp-grad-comm-dtype", "bf16"]) == settings(["--grad-reduce-in-bf16"])
    assert settings(["--megatron-fsdp-grad-comm-dtype", "bf16", "--megatron-fsdp-main-grads-dtype", "bf16"]) == \
        settings(["--grad-reduce-in-bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"])
    assert settings(["--megatron-fsdp-grad-comm-dtype", "auto", "--megatron-fsdp-main-grads-dtype", "fp32"]) == \
        settings([])
