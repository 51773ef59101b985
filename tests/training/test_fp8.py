"""FP8 training (Megatron-LM's --fp8-* flags) without Transformer Engine: the rules at start-up, the CPU FP8 layers'
delayed scaling, megatron.fsdp against Megatron-Core DDP under the same recipe, and checkpoints that resume."""

from __future__ import annotations

import pytest

from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.arguments.precision_flags import fp8_start_up_line
from megatron.fsdp_training.arguments.substitutions import substitution_line
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.testing.pools import pool_of
from tests.cases.job_runs import MODEL, assert_exact_resume, generate_in_pool, pretrain


# One micro-batch per rank and step on 2 ranks, no clipping: the gradient sums of DDP and of every
# megatron.fsdp level are then the same additions, so FP8 runs (whose rounding amplifies one-ulp
# differences) can be compared bitwise. fp32 compute: Megatron-Core's bf16 (Float16Module) and the
# engine's differ by bf16 roundings of their own.
FP8_PARITY = MODEL + ["--micro-batch-size", "4", "--global-batch-size", "8", "--clip-grad", "0"]


def delayed_scaling_case(ctx, history_len: int, algo: str) -> dict:
    """One ``Fp8ColumnParallelLinear`` (hybrid, delayed) on every rank of the pool, three training steps with
    rank-dependent inputs and a validation forward between them; returns what the layer holds and what it
    should hold (the max over ranks of each step's amaxes, TE's window and scale rule), and the GEMM output of
    the third step against the product of the operands quantized with the scales of step 2."""
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode
    from megatron.fsdp.mcore_cpu.fp8_matmul import Fp8Recipe
    from megatron.fsdp.mcore_cpu.fp8_linears import Fp8ColumnParallelLinear, Fp8StepEnd
    from megatron.fsdp.precision import fp8
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    with megatron_case():
        ps.initialize_model_parallel()
        enable_cpu_mode(1)
        rank = dist.get_rank()
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                   gradient_accumulation_fusion=False)
        recipe = Fp8Recipe(format="hybrid", recipe="delayed", amax_history_len=history_len, amax_compute_algo=algo)
        torch.manual_seed(0)
        layer = Fp8ColumnParallelLinear(32, 64, config=config, init_method=torch.nn.init.normal_, bias=False,
                                        gather_output=False, fp8_recipe=recipe)
        step_end = Fp8StepEnd([layer])
        seen = {"input": [], "weight": [], "grad": []}  # the global amax of each step
        out = {}
        for step in range(3):
            generator = torch.Generator().manual_seed(100 * step + rank)
            x = (torch.randn(8, 2, 32, generator=generator) * (1 + rank + step)).requires_grad_()
            dy = torch.randn(8, 2, 64, generator=generator) * (3 - step + rank)
            scales = layer.fp8_forward_scale.clone(), layer.fp8_backward_scale.clone()
            y, _ = layer(x)
            y.backward(dy)
            if step == 2:
                qx = fp8.quantize_per_tensor(x.detach().reshape(-1, 32), scales[0][0], "e4m3")
                qw = fp8.quantize_per_tensor(layer.weight.detach(), scales[0][1], "e4m3")
                want = (qx.dequantize() @ qw.dequantize().t()).reshape(8, 2, 64)
                out["output_matches"] = torch.equal(y.detach(), want)
                qdy = fp8.quantize_per_tensor(dy.reshape(-1, 64), scales[1][0], "e5m2")
                out["dgrad_matches"] = torch.equal(x.grad.reshape(-1, 32), qdy.dequantize() @ qw.dequantize())
            for name, t in (("input", x), ("weight", layer.weight), ("grad", dy)):
                a = fp8.amax(t).reshape(1)
                dist.all_reduce(a, op=dist.ReduceOp.MAX)
                seen[name].append(float(a))
            layer.eval()
            with torch.no_grad():
                layer(torch.full((8, 2, 32), 1e4))  # validation: quantizes, records nothing
            layer.train()
            step_end()
        want_scales = []
        for name, fmt in (("input", 448.0), ("weight", 448.0), ("grad", 57344.0)):
            window = seen[name][-history_len:] if algo == "max" else seen[name][-1:]
            want_scales.append(fmt / max(window))
        out["scales"] = layer.fp8_forward_scale.tolist() + layer.fp8_backward_scale.tolist()
        out["want_scales"] = [float(torch.tensor(s, dtype=torch.float32)) for s in want_scales]
        out["history"] = layer.fp8_forward_history[:, 0].tolist()
        out["seen_input"] = seen["input"]
        layer.bfloat16()  # Megatron-Core's Float16Module: the weights become bf16, the scaling state stays fp32
        out["state_dtypes"] = sorted({str(b.dtype) for n, b in layer.named_buffers() if n.startswith("fp8_")})
        out["weight_dtype"] = str(layer.weight.dtype)
        out["ledger_gathers"] = step_end.ledger.calls("all_gather") if dist.get_world_size() > 1 else None
        return out

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
    # margin and amax history are delayed scaling's alone (Megatron-Core hands them to TE's DelayedScaling only)
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--fp8-margin", "3"],
     "--fp8-margin 3 would do nothing under --fp8-recipe mxfp8, which scales from each 32-element block's amax"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "8", "--fp8-amax-compute-algo",
      "max"], "--fp8-amax-history-len 8, --fp8-amax-compute-algo max would do nothing under --fp8-recipe tensorwise"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise", "--fp8-margin", "1"],
     "--fp8-margin 1 would do nothing under --fp8-recipe blockwise"),
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


DELAYED_ZERO3 = FP8_PARITY + HYBRID_DELAYED + fsdp("optim_grads_params") + ["--fp8-param-gather"]


@pytest.fixture(scope="module")
def delayed_run(tmp_path_factory):
    """A delayed-scaling ZeRO-3 run that saves at 5 and 10: its directory and history."""
    root = tmp_path_factory.mktemp("fp8_delayed")
    return root, pretrain(2, DELAYED_ZERO3 + ["--save", str(root), "--save-interval", "5"])


def test_delayed_fp8_checkpoints_resume_exactly_and_at_another_dp_size(delayed_run):
    """fsdp_dtensor holds the amax histories (the layers' and, under --fp8-param-gather, the engine's of the
    weights): resumed on 2 ranks the run continues bitwise; on 4 ranks the loaded scales are the saved ones and the
    validation loss before any step is the saved run's."""
    tmp_path, straight = delayed_run
    argv = DELAYED_ZERO3
    resumed = pretrain(2, argv + ["--load", str(tmp_path), "--ckpt-step", "5"], capture_log=True)
    assert "amax histories" not in resumed["log"]  # the same recipe: loaded, nothing to say
    assert_exact_resume(straight, resumed, 5)
    assert resumed["fp8_scales"] == straight["fp8_scales"]
    loaded = {ranks: pretrain(ranks, argv + ["--micro-batch-size", "2", "--load", str(tmp_path), "--ckpt-step", "5",
                                             "--train-iters", "5", "--use-checkpoint-opt_param-scheduler"])
              for ranks in (2, 4)}
    assert loaded[2]["fp8_scales"] == loaded[4]["fp8_scales"] != straight["fp8_scales"]
    assert all(s != [1.0] * len(s) for s in loaded[4]["fp8_scales"].values())
    assert abs(loaded[4]["valid_at_load"] - straight["valid"][0]) <= 1e-6 * straight["valid"][0]


def test_which_fp8_state_a_load_takes():
    """The histories load only under the same recipe (format, recipe, window, algorithm, margin, where the weights'
    histories live); otherwise one line says whether they are not loaded or start fresh."""
    from megatron.fsdp_training.checkpointing.fp8_state import is_scaling_state, plan

    delayed = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max",
                   fp8_margin=0, fp8_param_gather=True, use_megatron_fsdp=True)
    keys = ["model.decoder.layers.0.mlp.linear_fc1.weight", "model.decoder.layers.0.mlp.linear_fc1.fp8_forward_history",
            "model.decoder.layers.0.mlp.linear_fc1.weight._fp8_amax_history"]
    assert [is_scaling_state(k) for k in keys] == [False, True, True]
    assert plan(delayed, keys, delayed, "C") == plan({}, [], dict(fp8=None), "C")
    assert plan(delayed, keys, delayed, "C").load
    for change, said in ((dict(fp8=None), "this run has FP8 off: its FP8 amax histories and scales are not loaded"),
                         (dict(fp8_recipe="mxfp8"), "this run has --fp8-format hybrid --fp8-recipe mxfp8 "
                                                    "--fp8-param-gather: its FP8 amax histories and scales are not"),
                         (dict(fp8_amax_history_len=8), "--fp8-amax-history-len 8 --fp8-amax-compute-algo max "
                                                        "--fp8-param-gather: the checkpoint's FP8 amax histories"),
                         (dict(fp8_margin=1), "this run's start fresh"),
                         (dict(use_megatron_fsdp=False), "this run's start fresh")):
        got = plan(delayed, keys, dict(delayed, **change), "C")
        assert not got.load and said in got.line, (change, got)
    fresh = plan(dict(fp8=None), keys[:1], delayed, "C")
    assert not fresh.load and "start fresh (the checkpoint has none)" in fresh.line
    converted = plan(delayed, keys[:1], delayed, "C")  # an FP8 run's weights, converted: no histories
    assert not converted.load and "holds no FP8 amax histories (converted from a run with" in converted.line


def test_an_fp8_checkpoint_never_locks_a_run_in(delayed_run, tmp_path):
    """A delayed-scaling checkpoint resumes with FP8 off (weights and optimizer bitwise those of the same checkpoint
    with its histories removed), its successor in bf16 resumes with FP8 on (histories fresh), it fine-tunes under
    MXFP8, and converts to HuggingFace and torch_dist (the baseline loads that under FP8): one line each where
    FP8 state is left."""
    import torch

    from megatron.fsdp_training.tools.checkpoint_tools import convert, hf_convert, torch_dist_convert

    saved, straight = delayed_run
    load5 = ["--load", str(saved), "--ckpt-step", "5"]
    off = pretrain(2, FP8_PARITY + fsdp("optim_grads_params") + load5 + ["--save", str(tmp_path / "bf16"),
                                                                         "--save-interval", "8"], capture_log=True)
    assert "this run has FP8 off: its FP8 amax histories and scales are not loaded (the weights are)" in off["log"]
    assert off["start_iteration"] == 5 and len(off["losses"]) == 5
    assert all(abs(a - b) < 0.02 * b for a, b in zip(off["losses"], straight["losses"][5:]))  # FP8 rounding apart
    # the same checkpoint without its histories: bitwise the same run
    convert.to_torch(str(saved), str(tmp_path / "full.pt"), iteration=5)
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    full["model"] = {k: v for k, v in full["model"].items() if "fp8" not in k}
    torch.save(full, tmp_path / "stripped.pt")
    convert.from_torch(str(tmp_path / "stripped.pt"), str(tmp_path / "stripped"))
    bare = pretrain(2, FP8_PARITY + fsdp("optim_grads_params") + ["--load", str(tmp_path / "stripped")])
    assert (bare["losses"], bare["valid_at_load"]) == (off["losses"], off["valid_at_load"])

    # bf16 -> FP8 delayed: the histories start fresh, and advance
    on = pretrain(2, DELAYED_ZERO3 + ["--load", str(tmp_path / "bf16"), "--ckpt-step", "8"], capture_log=True)
    assert "this run has --fp8-format hybrid --fp8-recipe delayed" in on["log"] and "start fresh" in on["log"]
    assert on["start_iteration"] == 8 and len(on["losses"]) == 2
    assert all(s != [1.0] * len(s) for s in on["fp8_scales"].values())

    # --finetune under another recipe: the trained weights (the first loss is the saved run's, not a fresh model's)
    tuned = pretrain(2, FP8_PARITY + RECIPES["mxfp8"] + fsdp("optim_grads_params") + load5 + [
        "--finetune", "--train-iters", "3"], capture_log=True)
    assert "--fp8-recipe mxfp8: its FP8 amax histories and scales are not loaded" in tuned["log"]
    assert "for fine-tuning" in tuned["log"] and abs(tuned["losses"][0] - straight["losses"][5]) < 0.02 * 6

    said = pool_of(2).run(generate_in_pool, timeout=120, argv=["--load", str(saved), "--ckpt-step", "5", "--prompt",
                                                               "1 2", "--max-new-tokens", "3", "--greedy"])
    assert len(said[0]["ids"]) == 3 and said[0]["ids"] == said[1]["ids"]

    report = hf_convert.to_hf(str(saved), str(tmp_path / "hf"), iteration=5)
    assert "not converted: 48 FP8 amax histories and scales" in report.note  # 2 layers x 4 linears x (4 + 2)
    from safetensors import safe_open

    with safe_open(str(next((tmp_path / "hf").glob("*.safetensors"))), "pt") as f:
        assert f.keys() and not [k for k in f.keys() if "fp8" in k]
    torch_dist_convert.to_torch_dist(str(saved), str(tmp_path / "td"), iteration=5)
    baseline = pretrain(2, FP8_PARITY + HYBRID_DELAYED + ["--use-distributed-optimizer", "--load", str(tmp_path / "td")],
                        capture_log=True)
    assert "holds no FP8 amax histories (converted from a run with --fp8-format hybrid" in baseline["log"]
    assert baseline["start_iteration"] == 5 and len(baseline["losses"]) == 5
