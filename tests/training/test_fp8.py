"""FP8 training (Megatron-LM's --fp8-* flags) without Transformer Engine: the rules at start-up, the CPU FP8 layers'
delayed scaling, megatron.fsdp against Megatron-Core DDP under the same recipe, and checkpoints that resume."""

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.arguments.fp8 import fp8_start_up_line
from megatron.fsdp_training.arguments.substitutions import substitution_line
from megatron.fsdp_training.testing.fp8 import FP8_PARITY, delayed_scaling_case
from megatron.fsdp_training.testing.job import assert_exact_resume, fsdp, pretrain
from megatron.fsdp_training.testing.pools import pool_of

HYBRID_DELAYED = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
RECIPES = {"delayed": HYBRID_DELAYED, "mxfp8": ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
           "tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]}


@pytest.mark.parametrize("argv, pattern", [
    (["--fp8-param-gather"], "--fp8-param-gather configure FP8 training: add --fp8-format"),
    (["--fp8-recipe", "mxfp8", "--fp8-margin", "1"], "--fp8-recipe, --fp8-margin configure FP8 training"),
    (["--fp8-format", "hybrid", "--fp8-param-gather"], "--fp8-param-gather only supported with distributed optimizer"),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"], "Delayed scaling does not support first / last layer"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--first-last-layers-bf16",
      "--num-layers-at-start-in-bf16", "5"], "--num-layers-at-start-in-bf16 5 must be between 0 and .* \\(4\\)"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], "blockwise's 1x128 activation and gradient tiles"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "custom"], "--fp8-quantizer-factory"),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0 must be at least 1"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--hidden-size", "80", "--num-attention-heads", "4"],
     "--hidden-size \\(80\\).* must be multiples of 32"),
])
def test_fp8_rules_stop_start_up_with_one_line(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        validate_args(parse_args(["--mock-data", "--num-layers", "4"] + argv), 2)


def test_the_start_up_line_says_how_fp8_runs():
    args = validate_args(parse_args(["--mock-data", "--use-megatron-fsdp", "--num-layers", "4", "--fp8-format",
                                     "hybrid", "--fp8-recipe", "mxfp8", "--first-last-layers-bf16"]), 2)
    assert fp8_start_up_line(args) == (
        "> FP8 (no Transformer Engine): hybrid mxfp8 recipe: inputs and weights E4M3, output gradients E5M2, "
        "32-element blocks with E8M0 scales, GEMMs on the dequantized operands in fp32 (no block-scaled CPU kernel); "
        "layers 2-3 of 4 in FP8; each layer quantizes its compute weight")
    args = validate_args(parse_args(["--mock-data", "--use-distributed-optimizer"] + HYBRID_DELAYED + [
        "--fp8-param-gather", "--no-fp8-wgrad", "--fp8-margin", "1"]), 2)
    assert "from a 4-step amax history (max), advanced once per optimizer step, margin 1, GEMMs through " \
           "torch._scaled_mm, weight gradients in the compute dtype (--no-fp8-wgrad)" in fp8_start_up_line(args)
    assert "--fp8-param-gather -> bf16 weights gathered, quantized by each layer every forward" in substitution_line(args)
    assert fp8_start_up_line(validate_args(parse_args(["--mock-data"]), 2)) is None


@pytest.mark.parametrize("history_len, algo", [(4, "max"), (1, "most_recent")])
def test_delayed_scaling_follows_transformer_engines_rule_over_all_ranks(history_len, algo):
    """Each step's amaxes, max over the 2 ranks, into the window; scale = max / amax of the window (or the newest);
    validation records nothing; the step's GEMMs use the scales from the steps before; bf16 casts leave the state
    fp32; one gather of all amaxes per step."""
    got = pool_of(2).run(delayed_scaling_case, timeout=120, history_len=history_len, algo=algo)
    assert got[0]["scales"] == got[1]["scales"] == got[0]["want_scales"], got
    assert got[0]["output_matches"] and got[0]["dgrad_matches"] and got[1]["output_matches"], got
    if history_len == 4:
        assert got[0]["history"] == [0.0] + got[0]["seen_input"], got[0]
    assert got[0]["state_dtypes"] == ["torch.float32"] and got[0]["weight_dtype"] == "torch.bfloat16"
    assert got[0]["ledger_gathers"] == 3


@pytest.fixture(scope="module")
def without_fp8():
    return pretrain(2, FP8_PARITY + fsdp("optim_grads_params"))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fsdp_zero3_trains_as_megatron_ddp_under_the_same_fp8_recipe(recipe, without_fp8):
    """10 iterations, 2 ranks: megatron.fsdp ZeRO-3 and Megatron-Core DDP with the same FP8 recipe give the same
    losses and validation losses bitwise, grad norms within 1e-6 (summed in another order), and (delayed) the same
    scales in every layer."""
    ddp = pretrain(2, FP8_PARITY + RECIPES[recipe])
    zero3 = pretrain(2, FP8_PARITY + RECIPES[recipe] + fsdp("optim_grads_params"))
    assert len(ddp["losses"]) == 10 and ddp["losses"] == zero3["losses"], (ddp["losses"], zero3["losses"])
    assert ddp["valid"] == zero3["valid"]
    # the norm sums its squares per shard here, per parameter there: the one sum in another order
    assert all(abs(a - b) <= 1e-6 * a for a, b in zip(ddp["grad_norms"], zero3["grad_norms"])), ddp["grad_norms"]
    assert ddp["fp8_scales"] == zero3["fp8_scales"]
    assert (len(ddp["fp8_scales"]) == 16) == (recipe == "delayed")  # 2 layers x 4 linears x (forward, backward)
    assert all(abs(a - b) > 1e-6 for a, b in zip(zero3["losses"][1:], without_fp8["losses"][1:]))  # FP8 GEMMs ran


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_param_gather_computes_with_the_weights_quantized_from_fp32(recipe):
    """--fp8-param-gather at ZeRO-3: the layers compute with megatron.fsdp's FP8 bytes of the fp32 main weights,
    bitwise the losses of DDP quantizing the same fp32 weights (per-tensor recipes); mxfp8 re-quantizes the input
    gradient's blocks from the gathered weight, so its reference is the engine's no_shard level."""
    gathered = pretrain(2, FP8_PARITY + RECIPES[recipe] + fsdp("optim_grads_params") + ["--fp8-param-gather"])
    reference = pretrain(2, FP8_PARITY + RECIPES[recipe] + (
        fsdp("no_shard") + ["--fp8-param-gather"] if recipe == "mxfp8" else []))
    assert len(gathered["losses"]) == 10 and gathered["losses"] == reference["losses"], (gathered, reference)
    assert gathered["valid"] == reference["valid"]


def test_delayed_fp8_checkpoints_resume_exactly_and_at_another_dp_size(tmp_path):
    """fsdp_dtensor holds the amax histories (the layers' and, under --fp8-param-gather, the engine's of the
    weights): resumed on 2 ranks the run continues bitwise; on 4 ranks the loaded scales are the saved ones and the
    validation loss before any step is the saved run's."""
    argv = FP8_PARITY + HYBRID_DELAYED + fsdp("optim_grads_params") + ["--fp8-param-gather"]
    straight = pretrain(2, argv + ["--save", str(tmp_path), "--save-interval", "5"])
    resumed = pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5"])
    assert_exact_resume(straight, resumed, 5)
    assert resumed["fp8_scales"] == straight["fp8_scales"]
    loaded = {ranks: pretrain(ranks, argv + ["--micro-batch-size", "2", "--load", str(tmp_path), "--ckpt-step", "5",
                                             "--train-iters", "5", "--use-checkpoint-opt_param-scheduler"])
              for ranks in (2, 4)}
    assert loaded[2]["fp8_scales"] == loaded[4]["fp8_scales"] != straight["fp8_scales"]
    assert all(s != [1.0] * len(s) for s in loaded[4]["fp8_scales"].values())
    assert abs(loaded[4]["valid_at_load"] - straight["valid"][0]) <= 1e-6 * straight["valid"][0]
