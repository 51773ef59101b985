"""HuggingFace in and out (``convert.py to-hf`` / ``from-hf``).

- A GPT-2-shaped model trained at TP 2 x DP 2, a Llama-shaped one (GQA, SwiGLU,
  RoPE, untied) at PP 2 x DP 2 and a Mixtral-shaped MoE at EP 2 x DP 2, all ZeRO-3
  and saved: each export loads in ``transformers`` with no missing or unexpected
  keys and gives the Megatron model's logits within 1e-5 (fp32), padded vocabulary
  rows dropped;
- HF -> fsdp_dtensor -> HF is bitwise (every tensor, and config.json);
- a model made and saved by ``transformers`` itself -> from-hf -> ``pretrain_gpt``
  ``--load --finetune``: the first iteration's loss is the HF model's on that batch;
- Qwen2 with non-zero q/k/v biases (``--add-qkv-bias``) and Qwen2-MoE (gated shared expert,
  dense layers, router with and without ``norm_topk_prob``) made by transformers round-trip
  bitwise; the Qwen2-MoE's Megatron model has its logits within 1e-5 (MoE pool);
- conversion streams: peak resident memory grows by well under the model's size
  (a ~190 MB model, both directions, measured in a fresh process).

The training runs use the shared pools (tests/conftest.py), no new launches.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron.fsdp_training.testing.pretrain import pretrain_in_pool
from megatron.fsdp_training.tools.checkpoint_tools import convert, hf_convert
from tests.cases.hf import (ZERO3, exported_again_equals, finetune_from_hf, from_hf_with_flags, megatron_logits,
                            tensors)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2",
        "--mock-data", "--eval-iters", "1", "--seed", "5"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
         "--rotary-base", "500000"]
MIXTRAL = LLAMA[:-2] + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
MODELS = {  # name -> (model flags, the sharded layout it is trained and saved at, model type)
    "gpt2": ([], ["--tensor-model-parallel-size", "2"], "gpt2"),
    "llama": (LLAMA, ["--pipeline-model-parallel-size", "2"], "llama"),
    "mixtral": (MIXTRAL, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"], "mixtral"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_export_from_a_sharded_run_matches_megatron_logits(mcore_pool, tmp_path, name):
    _export_matches_megatron_logits(mcore_pool, tmp_path, name)


def _export_matches_megatron_logits(pool, tmp_path, name):
    from transformers import AutoModelForCausalLM

    flags, layout, model_type = MODELS[name]
    ckpt, hf_dir, back = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "back"
    pool.run(pretrain_in_pool, timeout=300,
             argv=BASE + flags + layout + ZERO3 + ["--save", str(ckpt)])
    report = hf_convert.to_hf(str(ckpt), str(hf_dir), model_type, max_shard_bytes=60_000)
    assert report.model_bytes > 0
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert len(shards) > 1 and (hf_dir / "model.safetensors.index.json").is_file()  # small shards: several
    model_file = tmp_path / "model.pt"
    convert.to_torch(str(ckpt), str(model_file), model_only=True)
    tokens = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 257, (2, 32), generator=tokens)
    got = pool.run(megatron_logits, timeout=300, argv=BASE + flags + ["--hidden-dropout", "0"],
                   model_file=str(model_file), tokens=tokens)[0]
    assert got["missing"] == [] and got["unexpected"] == [], got
    model, info = AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config.model_type == model_type and model.config.vocab_size == 257  # padding rows dropped
    # the job's tokenizer (ByteLevelTokenizer: eod 256, no padding id) gives the special ids
    ids = {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 256}
    assert json.loads((hf_dir / "generation_config.json").read_text()) == ids
    assert {k: getattr(model.generation_config, k) for k in ids} == ids
    assert {k: getattr(model.config, k) for k in ids} == ids
    megatron = got["logits"]
    assert megatron.shape[-1] > 257  # the checkpoint's rows are padded (384 or 512)
    hf = model.eval()(tokens).logits.detach()
    diff = (hf - megatron[..., :257]).abs().max().item()
    assert diff <= 1e-5, (name, diff)
    # ... and back: HF -> fsdp_dtensor -> HF is bitwise
    hf_convert.from_hf(str(hf_dir), str(back))
    again = tmp_path / "hf2"
    hf_convert.to_hf(str(back), str(again))
    first, second = tensors(hf_dir), tensors(again)
    assert sorted(first) == sorted(second)
    assert all(first[k].dtype == second[k].dtype and torch.equal(first[k], second[k]) for k in first)
    assert json.loads((hf_dir / "config.json").read_text()) == json.loads((again / "config.json").read_text())


def _hf_llama(vocab=257, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5)
    config = LlamaConfig(vocab_size=vocab, **{**shape, **overrides})
    return LlamaForCausalLM(config).eval()


def _byte_bpe(directory, text_dir):
    """A 257-id HF tokenizer (the 256 bytes and eod, no merges) saved into ``directory``."""
    from tools.train_hf_tokenizer import train_tokenizer

    text_dir.mkdir()
    (text_dir / "a.txt").write_text("def f(x):\n    return x\n" * 20)
    train_tokenizer([str(text_dir / "a.txt")], 257, str(directory))


def test_finetune_from_a_huggingface_model_has_its_loss(mcore_pool, tmp_path, capsys):
    """A Llama made and saved by transformers (max_position_embeddings 64, below the job's default
    --seq-length, with its tokenizer) -> ``convert.py from-hf``: the command line it prints, run at
    ZeRO-3 on 4 ranks, has as first loss the HF model's on the same batch; the weights then train."""
    hf = _hf_llama()
    hf.save_pretrained(tmp_path / "hf")
    _byte_bpe(tmp_path / "hf", tmp_path / "text")
    command, got, loss = finetune_from_hf(mcore_pool, hf, tmp_path / "hf", tmp_path / "ckpt", capsys, iterations=2)
    assert "--tokenizer-model" in command and "--hidden-dropout" in command
    assert got["tokens"].shape[1] == 64
    assert got["losses"][1] != got["losses"][0]


def test_export_writes_the_job_tokenizer(tmp_path):
    """A job trained with an HF tokenizer: to-hf's directory holds that tokenizer (AutoTokenizer loads
    it) and its eos as config.json's and generation_config.json's eos / bos / pad."""
    from transformers import AutoTokenizer

    from megatron.fsdp_training.tools.checkpoint_tools import hf_tokenizer

    _byte_bpe(tmp_path / "bpe", tmp_path / "text")
    out = tmp_path / "out"
    out.mkdir()
    common = {"args": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tmp_path / "bpe")}}
    config = hf_tokenizer.write_generation_files(out, {"model_type": "llama"}, common)
    loaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    eod = loaded.eos_token_id
    assert loaded("def f").input_ids == AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))("def f").input_ids
    assert config == {"model_type": "llama", "bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}
    assert json.loads((out / "generation_config.json").read_text()) == {k: eod for k in hf_tokenizer.SPECIAL}


def test_models_saved_by_transformers_round_trip(tmp_path):
    """GPT-2, Qwen2 and Mixtral made and saved by transformers itself (its own tensor layout: fused
    Mixtral experts in transformers 5) -> from-hf -> to-hf: they load again and give the same logits."""
    from transformers import AutoModelForCausalLM, GPT2Config, MixtralConfig, Qwen2Config

    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100, max_position_embeddings=32)
    configs = {"gpt2": GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=32,
                                  activation_function="gelu"),
               "qwen2": Qwen2Config(**small), "mixtral": MixtralConfig(**small, num_local_experts=3)}
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(tmp_path / name)
        hf_convert.from_hf(str(tmp_path / name), str(tmp_path / f"{name}-ckpt"))
        hf_convert.to_hf(str(tmp_path / f"{name}-ckpt"), str(tmp_path / f"{name}-out"))
        again, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{name}-out"), output_loading_info=True)
        assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (name, info)
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, again.eval()(tokens).logits), name


def test_errors_name_the_problem(tmp_path):
    hf = _hf_llama()
    hf.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(hf_convert.ConversionError, match="rope scaling 'linear' is not converted"):
        hf_convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_convert.from_hf(str(tmp_path), str(tmp_path / "ckpt"))
    _hf_llama().config.save_pretrained(tmp_path / "empty")  # a config, no weights
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        hf_convert.from_hf(str(tmp_path / "empty"), str(tmp_path / "ckpt"))


def _convert_in_a_fresh_process(*argv):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "checkpoint", "convert.py"), *argv],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"peak resident memory ([0-9.]+) MiB \(([0-9.]+) MiB before converting, \+([0-9.]+) MiB\); "
                  r"model ([0-9.]+) MiB", out.stdout)
    assert m, out.stdout
    return [float(x) for x in m.groups()]


def test_conversion_streams_below_the_model_size(tmp_path):
    """~190 MB of fp32 weights (12 layers, hidden 512): each direction grows the converting process's resident
    memory by well under the model's size (one layer and the largest tensor are what it holds)."""
    hf = _hf_llama(vocab=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                   num_attention_heads=8, num_key_value_heads=4)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="64MB")
    del hf
    peak_in, before_in, grown_in, size_in = _convert_in_a_fresh_process("from-hf", str(tmp_path / "hf"),
                                                                        str(tmp_path / "ckpt"))
    peak_out, before_out, grown_out, size_out = _convert_in_a_fresh_process(
        "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "0.05")
    assert size_in > 150 and abs(size_out - size_in) < 1, (size_in, size_out)
    print(f"from-hf: +{grown_in:.0f} MiB over {before_in:.0f} MiB; to-hf: +{grown_out:.0f} MiB over "
          f"{before_out:.0f} MiB; model {size_in:.0f} MiB")
    assert grown_in < 0.5 * size_in and grown_out < 0.5 * size_out, (grown_in, grown_out, size_in)


def _qwen2_moe(**overrides):
    """A transformers-made Qwen2-MoE: non-zero q/k/v biases, a dense first layer, 4 experts top-2, a gated
    shared expert; ``norm_topk_prob`` False (Megatron's --moe-router-pre-softmax)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    shape = dict(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                 shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, mlp_only_layers=[0],
                 rms_norm_eps=1e-5, norm_topk_prob=False)
    config = Qwen2MoeConfig(**{**shape, **overrides})
    torch.manual_seed(0)
    return _with_qkv_biases(AutoModelForCausalLM.from_config(config).eval())


def _with_qkv_biases(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"\.[qkv]_proj\.bias$", name):
                p.normal_(0.0, 0.5)
    return model


def test_qwen2_qkv_biases_and_qwen2_moe_round_trip(tmp_path):
    """Qwen2 with non-zero q/k/v biases (--add-qkv-bias) and Qwen2-MoE (shared expert + its sigmoid gate,
    router renormalized or not), made by transformers -> from-hf -> to-hf: the printed flags say so, every
    tensor and config.json come back bitwise (the Hub's per-expert names), and the model loads again."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    dense = _with_qkv_biases(AutoModelForCausalLM.from_config(Qwen2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=32)).eval())
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    cases = {"qwen2": (dense, ["--add-qkv-bias"]),
             "qwen2_moe": (_qwen2_moe(), ["--add-qkv-bias", "--moe-router-pre-softmax", "--moe-shared-expert-gate",
                                          "--moe-shared-expert-intermediate-size", "--moe-layer-freq"]),
             "qwen2_moe_norm": (_qwen2_moe(norm_topk_prob=True), ["--moe-shared-expert-gate"])}
    for name, (model, expected_flags) in cases.items():
        _, arch, flags = from_hf_with_flags(model, tmp_path, name, expected_flags, pre_softmax=name == "qwen2_moe")
        if name == "qwen2_moe":  # what Mixtral / an ungated shared expert cannot hold, named
            with pytest.raises(hf_convert.ConversionError, match="mixtral renormalizes.*no --moe-router-pre-softmax"):
                hf_convert.check_exportable("mixtral", arch)
            with pytest.raises(hf_convert.ConversionError, match="qwen2_moe needs .*--moe-shared-expert-gate"):
                hf_convert.check_exportable("qwen2_moe", dataclasses.replace(arch, shared_expert_gate=False))
        out = exported_again_equals(model, tmp_path / f"{name}-ckpt", tmp_path / f"{name}-out", tokens)
        if name.startswith("qwen2_moe"):
            assert "model.layers.1.mlp.experts.3.down_proj.weight" in out and "model.layers.0.mlp.gate_proj.weight" in out
        assert float(model.state_dict()["model.layers.0.self_attn.k_proj.bias"].abs().max()) > 0.1


def test_qwen2_moe_from_hf_matches_megatron_logits(mcore_pool, tmp_path):
    """A transformers-made Qwen2-MoE (q/k/v biases, a dense layer, gated shared expert, pre-softmax router)
    -> from-hf: the Megatron model of the printed flags gives the HF logits within 1e-5 (fp32)."""
    model = _qwen2_moe()
    model.save_pretrained(tmp_path / "hf")
    _, arch = hf_convert.from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    model_file = tmp_path / "model.pt"
    convert.to_torch(str(tmp_path / "ckpt"), str(model_file), model_only=True)
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(3))
    argv = BASE + arch.megatron_flags() + ["--make-vocab-size-divisible-by", "1", "--hidden-dropout", "0",
                                           "--attention-dropout", "0"]
    got = mcore_pool.run(megatron_logits, timeout=300, argv=argv, model_file=str(model_file), tokens=tokens)[0]
    assert got["missing"] == [] and got["unexpected"] == [], got
    with torch.no_grad():
        hf = model(tokens).logits
    diff = (hf - got["logits"]).abs().max().item()
    assert diff <= 1e-5, diff
