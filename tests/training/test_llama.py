"""Llama-shaped models through pretrain_gpt.py: --use-megatron-fsdp equals Megatron-Core DDP.

RMSNorm, SwiGLU, RoPE, grouped-query attention, untied embeddings, no biases and
Megatron-LM's default dropouts (0.1: the dropout masks must match too), in one shape
per topology, the four levels spread over the topologies (the full DP 4 x level matrix
is ``slow``), each topology adding a feature of its own (qk-layernorm, --kv-channels,
--calculate-per-token-loss, --lr-warmup-fraction, a shared expert with dense and MoE
layers mixed). Every case runs inside the long-lived 4-rank pools (no new processes).
"""

from __future__ import annotations

from typing import List

import pytest

from megatron.fsdp.testing.common import LEVELS
from megatron.fsdp_training.arguments import ArgumentError, parse_args, validate_args
from megatron.fsdp_training.arguments.moe_flags import moe_layer_freq_type
from megatron.fsdp_training.model_shape import swiglu_ffn_hidden_size
from megatron.fsdp_training.testing.job import fsdp
from megatron.fsdp_training.testing.pretrain import pretrain_in_pool


def local_spec_matches_cpu_spec(ctx, argv: List[str]) -> dict:
    """Build the model twice from the same seed: with the CPU spec, and with the block spec a GPU run
    builds (Megatron-Core's ``get_gpt_decoder_block_spec``, local layers: DotProductAttention, its
    norms); returns the layer types and the largest logit difference on one batch."""
    import torch

    from megatron.core import parallel_state as ps
    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.arguments import parse_args, validate_args
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    with megatron_case():
        args = validate_args(parse_args(argv), ctx.size)
        ps.initialize_model_parallel()
        config = model_lib.transformer_config(args, cpu=True)
        seq = args.seq_length
        tokens = torch.arange(2 * seq).reshape(2, seq) % 128
        positions = torch.arange(seq).expand(2, seq)
        mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
        result = {}
        for name, cpu in (("cpu", True), ("local", False)):
            enable_cpu_mode(args.seed)
            torch.manual_seed(args.seed)
            build = model_lib.ModelBuildConfig.from_args(args, cpu)
            spec = model_lib._layer_spec(config, build, None)
            model = model_lib.gpt_chunks(config, lambda vp_stage: spec, 128, seq, **build.gpt_model_kwargs())[0]
            result[name] = {"layers": [type(layer.mlp).__name__ for layer in model.decoder.layers],
                            "attention": type(model.decoder.layers[0].self_attention.core_attention).__name__,
                            "logits": model(tokens, positions, mask).detach()}
        result["max_diff"] = (result["cpu"].pop("logits") - result["local"].pop("logits")).abs().max().item()
        return result


LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3",
         "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--mock-data", "--eval-interval", "3", "--eval-iters", "1",
         "--seed", "11", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear"]
TOPOLOGIES = {  # name -> (extra arguments, levels checked in the default suite)
    "dp4": (["--qk-layernorm"], ["no_shard", "optim_grads_params"]),
    "tp2-dp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--kv-channels", "24",
                    "--calculate-per-token-loss"], ["optim_grads"]),
    "pp2-dp2": (["--pipeline-model-parallel-size", "2", "--lr-warmup-iters", "0",
                 "--lr-warmup-fraction", "0.4", "--rotary-percent", "0.5"], ["optim"]),
    "cp2-dp2-rope": (["--context-parallel-size", "2", "--rotary-base", "500000"], ["optim_grads_params"]),
    "moe-ep2-shared": (["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                        "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-intermediate-size",
                        "32", "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-aux-loss-coeff", "0.01"],
                       ["optim_grads_params"]),
}


def _run(pool, argv):
    return pool.run(pretrain_in_pool, timeout=300, argv=argv)[0]


def _assert_parity(got, base, what):
    for key in ("losses", "grad_norms", "valid"):
        assert len(got[key]) == len(base[key]) > 0, (what, key)
        for a, b in zip(got[key], base[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (what, key, got[key], base[key])


def _check(pool, name, levels):
    extra = TOPOLOGIES[name][0]
    base = _run(pool, LLAMA + extra)
    assert base["losses"][-1] < base["losses"][0] * 1.05  # trains, not diverging
    for level in levels:
        _assert_parity(_run(pool, LLAMA + extra + fsdp(level)), base, (name, level))


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_llama_matches_megatron_ddp(mcore_pool, name):
    """One Llama shape per topology at the level(s) of TOPOLOGIES, against Megatron-Core DDP (the MoE shape:
    a shared expert, a dense first layer)."""
    _check(mcore_pool, name, TOPOLOGIES[name][1])


@pytest.mark.slow
def test_llama_dp4_every_level(mcore_pool):
    _check(mcore_pool, "dp4", LEVELS)


# ------------------------------------------------------------------ start-up checks
def _validated(argv, world=4):
    return validate_args(parse_args(["--mock-data"] + argv), world)


def test_architecture_defaults_follow_megatron_lm():
    args = _validated([])
    assert (args.normalization, args.norm_epsilon, args.position_embedding_type) == ("LayerNorm", 1e-5,
                                                                                      "learned_absolute")
    assert (args.hidden_dropout, args.attention_dropout, args.rotary_base, args.rotary_percent) == (0.1, 0.1,
                                                                                                   10000, 1.0)
    assert args.kv_channels == args.hidden_size // args.num_attention_heads and args.num_query_groups is None
    args = _validated(["--swiglu", "--hidden-size", "4096", "--num-attention-heads", "32", "--group-query-attention"])
    assert args.ffn_hidden_size == swiglu_ffn_hidden_size(4096) == 10880  # Llama-2-7B's 11008 is set explicitly
    assert args.num_query_groups == 1  # Megatron-LM: GQA without a count is multi-query attention
    args = _validated(["--lr-warmup-fraction", "0.1", "--train-iters", "50"])
    assert args.lr_warmup_iters == 0 and args.lr_warmup_fraction == 0.1
    assert moe_layer_freq_type("2") == 2 and moe_layer_freq_type("'([0]*1+[1]*3)'") == [0, 1, 1, 1]
    assert moe_layer_freq_type("[1,0]*2") == [1, 0, 1, 0]


@pytest.mark.parametrize("argv, pattern", [
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], "must divide --num-attention-heads 4"),
    (["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
     "not divisible by --tensor-model-parallel-size 2"),
    (["--hidden-size", "66"], "set --kv-channels"),
    (["--kv-channels", "0"], "--kv-channels=0 must be at least 1"),
    (["--hidden-dropout", "1.0"], r"--hidden-dropout=1.0 must be in \[0, 1\)"),
    (["--attention-dropout", "-0.1"], "--attention-dropout=-0.1 must be in"),
    (["--norm-epsilon", "0"], "--norm-epsilon=0.0 must be positive"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent=0.0 must be in"),
    (["--position-embedding-type", "rope", "--kv-channels", "5"], "RoPE needs an even number"),
    (["--moe-layer-freq", "2"], "need --num-experts"),
    (["--moe-shared-expert-intermediate-size", "8"], "need --num-experts"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-layer-freq", "[1,0,1]"], "one 0 \\(dense\\) or 1"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-layer-freq", "[0,0,0,0]"], "makes no layer an MoE"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-intermediate-size", "0"],
     "must be at least 1"),
    (["--num-experts", "4", "--disable-bias-linear", "--moe-shared-expert-gate"],
     "--moe-shared-expert-gate gates the shared expert: it needs --moe-shared-expert-intermediate-size"),
    (["--moe-router-pre-softmax"], "need --num-experts"),
    (["--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size", "0"],
     "--expert-model-parallel-size=0 must be at least 1"),
    (["--num-experts", "4", "--disable-bias-linear", "--expert-tensor-parallel-size", "0"],
     "--expert-tensor-parallel-size=0 must be at least 1"),
    (["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "0"],
     "--num-distributed-optimizer-instances=0 must be at least 1"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "give one of them"),
    (["--lr-warmup-fraction", "1.5"], r"--lr-warmup-fraction=1.5 must be in \[0, 1\)"),
])
def test_architecture_startup_errors(argv, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        _validated(argv)


def test_moe_layer_freq_rejects_code():
    with pytest.raises(ArgumentError, match="--moe-layer-freq"):
        parse_args(["--moe-layer-freq", "__import__('os').getcwd()"])


def test_gpu_block_spec_builds_the_same_model(mcore_pool):
    """What a GPU run builds (Megatron-Core's block spec, local layers) equals the CPU spec: same layer
    pattern (--moe-layer-freq), same logits from the same seed (GQA, RoPE, RMSNorm, qk-layernorm).
    Each rank of the pool builds both models by itself (DP 4, no collective)."""

    argv = ["--mock-data", "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
            "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear", "--qk-layernorm",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-experts", "2", "--moe-layer-freq", "[1,0,1]",
            "--moe-shared-expert-intermediate-size", "16"]
    got = mcore_pool.run(local_spec_matches_cpu_spec, timeout=300, argv=argv)[0]
    assert got["cpu"]["layers"] == got["local"]["layers"] == ["MoELayer", "MLP", "MoELayer"]
    assert (got["cpu"]["attention"], got["local"]["attention"]) == ("SDPACoreAttention", "DotProductAttention")
    assert got["max_diff"] < 1e-5, got["max_diff"]
