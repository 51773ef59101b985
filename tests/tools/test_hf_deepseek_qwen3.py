"""HuggingFace in and out for DeepSeek-V3 and Qwen3 / Qwen3-MoE (``convert.py to-hf`` / ``from-hf``).

- A DeepSeek-V3-shaped model trained by the job (MLA with --q-lora-rank, one MTP layer, sigmoid routing
  with the expert bias moved by training, group-limited top-k, a shared expert, a dense first layer) at
  EP 2 x DP 2 ZeRO-3, a Qwen3 (qk-layernorm, GQA, --kv-channels apart from hidden / heads) at DP 4 ZeRO-3
  and a Qwen3-MoE at EP 2: each export loads in transformers and gives the job's model's logits within
  1e-5 (fp32; the max abs difference is printed); the DeepSeek-V3 export holds the MTP layer as the Hub
  stores it (transformers reports those keys, and only those, as unexpected); from-hf of each export and to-hf
  again give every tensor and config.json bitwise;
- a Qwen3 and a DeepSeek-V3 made and saved by transformers -> ``convert.py from-hf``: the printed command,
  trained at ZeRO-3, has as first loss the HF model's on that batch;
- Qwen3 / Qwen3-MoE / DeepSeek-V3 made by transformers (its interleaved-RoPE layout, fused or per-expert
  names) round-trip bitwise; what cannot be represented stops with one line naming it and the fix.

The training runs use the shared Megatron pool (tests/conftest.py), no new launches.
"""

import dataclasses
import json

import pytest
import torch

from megatron.fsdp_training.testing.pretrain import pretrain_in_pool
from megatron.fsdp_training.tools.checkpoint_tools import convert, hf_convert
from tests.cases.hf import (DEEPSEEK_MODEL, ZERO3, exported_again_equals, finetune_from_hf, from_hf_with_flags,
                            megatron_logits, tensors)

EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
# The DeepSeek-V3 test model with what transformers' DeepseekV3 fixes: latent norms' epsilon 1e-6, and a
# group scored by its top 2 experts (Megatron-Core: top topk / group_topk, so top-k 4 of 2 groups).
DEEPSEEK = DEEPSEEK_MODEL + ["--norm-epsilon", "1e-6", "--moe-router-topk", "4", "--train-iters", "3",
                             "--eval-interval", "3", "--global-batch-size", "4"]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2",
        "--mock-data", "--eval-iters", "1", "--seed", "5", "--hidden-dropout", "0", "--attention-dropout", "0"]
QWEN3 = BASE + ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--position-embedding-type",
                "rope", "--qk-layernorm", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "24",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--rotary-base", "1000000"]
QWEN3_MOE = QWEN3 + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
                     "--moe-layer-freq", "[0,1]"]
MODELS = {  # name -> (flags, the sharded layout trained and saved at)
    "deepseek_v3": (DEEPSEEK, EP2),
    "qwen3": (QWEN3, []),
    "qwen3_moe": (QWEN3_MOE, EP2),
}


def _without_mtp(flags):
    out = list(flags)
    for flag in ("--mtp-num-layers", "--mtp-loss-scaling-factor"):
        if flag in out:
            del out[out.index(flag):out.index(flag) + 2]
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_export_from_the_job_matches_its_logits(mcore_pool, tmp_path, name):
    from transformers import AutoModelForCausalLM

    flags, layout = MODELS[name]
    ckpt, hf_dir, back, again = (tmp_path / d for d in ("ckpt", "hf", "back", "hf2"))
    mcore_pool.run(pretrain_in_pool, timeout=300, argv=flags + layout + ZERO3 + ["--save", str(ckpt)])
    report = hf_convert.to_hf(str(ckpt), str(hf_dir))  # the type comes from the model's shape
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == name
    model_file = tmp_path / "model.pt"
    convert.to_torch(str(ckpt), str(model_file), model_only=True)
    # The main model's logits (GPTModel's MTP forward needs labels): its weights without the MTP layer's.
    state = torch.load(model_file, weights_only=False)
    torch.save({k: v for k, v in state.items() if not k.startswith("mtp.")}, model_file)
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    got = mcore_pool.run(megatron_logits, timeout=300, argv=_without_mtp(flags), model_file=str(model_file),
                         tokens=tokens)[0]
    assert got["missing"] == [] and got["unexpected"] == [], got
    model, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    mtp = sorted(k for k in tensors(hf_dir) if k.startswith("model.layers.2."))
    if name == "deepseek_v3":  # the MTP layer as the Hub stores it, which transformers does not load
        assert config["num_nextn_predict_layers"] == 1 and config["rope_interleave"] is True
        assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.hnorm.weight",
                "model.layers.2.shared_head.norm.weight", "model.layers.2.shared_head.head.weight",
                "model.layers.2.embed_tokens.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
                "model.layers.2.self_attn.q_b_proj.weight"} <= set(mtp)
        # (transformers names the MTP experts fused, as it holds experts)
        unexpected = set(info["unexpected_keys"])
        assert all(k.startswith("model.layers.2.") for k in unexpected), unexpected
        assert {k for k in mtp if ".mlp.experts." not in k} <= unexpected, set(mtp) - unexpected
        assert "MTP: 1 layer(s) written" in report.note
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert float(bias.abs().max()) > 0  # the expert bias training moved
    else:
        assert mtp == [] and not info["unexpected_keys"] and report.note == ""
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        hf = model.eval()(tokens).logits
    diff = (hf - got["logits"][..., :257]).abs().max().item()
    print(f"{name}: max abs logits difference, transformers vs the job's model (fp32): {diff:.3g}")
    assert diff <= 1e-5, (name, diff)
    # ... and back: from-hf (the MTP layer read, its copies checked) -> to-hf is bitwise
    report, arch = hf_convert.from_hf(str(hf_dir), str(back))
    assert ("--mtp-num-layers" in arch.megatron_flags()) == (name == "deepseek_v3")
    if name == "deepseek_v3":
        assert "MTP: 1 layer(s) read from model.layers.2.*" in report.note
    hf_convert.to_hf(str(back), str(again))
    first, second = tensors(hf_dir), tensors(again)
    assert sorted(first) == sorted(second)
    assert all(first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]) for k in first)
    assert json.loads((again / "config.json").read_text()) == config


def _small(kind, **overrides):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3Config, Qwen3MoeConfig

    shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, head_dim=16)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
    config = {
        "qwen3": lambda: Qwen3Config(**shape),
        "qwen3_moe": lambda: Qwen3MoeConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                            mlp_only_layers=[0]),
        "deepseek_v3": lambda: DeepseekV3Config(
            vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
            num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=64, rope_parameters=yarn),
    }[kind]()
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and the expert bias away from their initial ones and zeros
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.normal_(0.0, 0.1)
    return model


def test_models_saved_by_transformers_round_trip(tmp_path):
    """Qwen3, Qwen3-MoE (norm_topk_prob true and false) and DeepSeek-V3 (interleaved RoPE, and not) made by
    transformers -> from-hf -> to-hf: the flags say so, every tensor comes back bitwise, same logits."""
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    cases = {"qwen3": (_small("qwen3"), ["--qk-layernorm", "--kv-channels"]),
             "qwen3_moe": (_small("qwen3_moe", norm_topk_prob=False), ["--moe-router-pre-softmax", "--qk-layernorm"]),
             "qwen3_moe_norm": (_small("qwen3_moe", norm_topk_prob=True), ["--moe-layer-freq"]),
             "deepseek_v3": (_small("deepseek_v3"), ["--multi-latent-attention", "--moe-router-enable-expert-bias"]),
             "deepseek_v3_plain_rope": (_small("deepseek_v3", rope_interleave=False), ["--q-lora-rank"])}
    for name, (model, expected) in cases.items():
        report, _, flags = from_hf_with_flags(model, tmp_path, name, expected, pre_softmax=name == "qwen3_moe")
        if name.startswith("deepseek"):  # its config declares an MTP layer that transformers never saves
            assert "files hold no model.layers.2.*: converted without MTP" in report.note
            assert "--mtp-num-layers" not in flags
        exported_again_equals(model, tmp_path / f"{name}-ckpt", tmp_path / f"{name}-out", tokens)


def test_deepseek_v3_from_hf_matches_megatron_logits(mcore_pool, tmp_path):
    """A transformers-made DeepSeek-V3 (interleaved RoPE rows, YaRN factor 40) -> from-hf: the Megatron model
    of the printed flags gives the HF logits within 1e-5 (fp32)."""
    model = _small("deepseek_v3")
    model.save_pretrained(tmp_path / "hf")
    _, arch = hf_convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    model_file = tmp_path / "model.pt"
    convert.to_torch(str(tmp_path / "ckpt"), str(model_file), model_only=True)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    argv = BASE + arch.megatron_flags() + ["--make-vocab-size-divisible-by", "1"]
    got = mcore_pool.run(megatron_logits, timeout=300, argv=argv, model_file=str(model_file),
                         tokens=tokens)[0]
    assert got["missing"] == [] and got["unexpected"] == [], got
    with torch.no_grad():
        diff = (model(tokens).logits - got["logits"]).abs().max().item()
    print(f"deepseek_v3 from-hf: max abs logits difference, transformers vs Megatron (fp32): {diff:.3g}")
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_finetune_from_a_transformers_model_has_its_loss(mcore_pool, tmp_path, capsys, name):
    """A Qwen3 / DeepSeek-V3 made and saved by transformers -> ``convert.py from-hf``: the printed command,
    run at ZeRO-3 on 4 ranks, has as first loss the HF model's on the same batch."""
    model = _small(name, vocab_size=257)
    model.save_pretrained(tmp_path / "hf")
    command, _got, _loss = finetune_from_hf(mcore_pool, model, tmp_path / "hf", tmp_path / "ckpt", capsys, 1)
    assert "--qk-layernorm" in command
    assert ("--multi-latent-attention" in command) == (name == "deepseek_v3")


def test_errors_name_the_problem(tmp_path):
    from megatron.fsdp_training.tools.checkpoint_tools.hf_layouts_deepseek import DeepseekArch, arch_from_hf

    _, arch = hf_convert.arch_from_hf(_small("deepseek_v3").config.to_dict())
    assert isinstance(arch, DeepseekArch)
    for change, message in (
            (dict(norm_epsilon=1e-5), "deepseek_v3 needs --norm-epsilon 1e-06"),
            (dict(moe_router_topk=2), "needs --moe-router-topk = 2 x --moe-router-group-topk"),
            (dict(expert_bias=False), "needs --moe-router-enable-expert-bias"),
            (dict(moe_layers=(1, 0)), "--moe-layer-freq \\[1, 0\\] is not of that form"),
            (dict(shared_expert_size=24), "not a multiple of --moe-ffn-hidden-size 16")):
        with pytest.raises(hf_convert.ConversionError, match=message):
            hf_convert.check_exportable("deepseek_v3", dataclasses.replace(arch, **change))
    with pytest.raises(hf_convert.ConversionError, match="multi-latent attention has a place in deepseek_v3 only"):
        hf_convert.check_exportable("llama", arch)
    _, qwen3 = hf_convert.arch_from_hf(_small("qwen3").config.to_dict())
    with pytest.raises(hf_convert.ConversionError, match="qwen3 needs --qk-layernorm"):
        hf_convert.check_exportable("qwen3", dataclasses.replace(qwen3, qk_layernorm=False))
    with pytest.raises(hf_convert.ConversionError, match="use --model-type qwen3 or qwen3_moe"):
        hf_convert.rules_for("llama", qwen3)
    config = _small("deepseek_v3").config.to_dict()
    for key, value, message in (("beta_fast", 16, "YaRN beta_fast 16: Megatron-Core fixes it at 32"),
                                ("attention_factor", 1.5, "YaRN attention factor 1.5"),
                                ("rope_type", "linear", "rope type 'linear' is not converted")):
        bad = dict(config, rope_parameters=dict(config["rope_parameters"], **{key: value}))
        with pytest.raises(hf_convert.ConversionError, match=message):
            arch_from_hf(bad)
    with pytest.raises(hf_convert.ConversionError, match="rms_norm_eps 1e-05"):
        arch_from_hf(dict(config, rms_norm_eps=1e-5))
