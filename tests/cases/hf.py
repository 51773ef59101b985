"""What the Hugging Face conversion tests share (test_hf_checkpoints, test_hf_deepseek_qwen3, test_hf_input_checks),
and the DeepSeek-V3-shaped tiny model that tests/training/test_deepseek.py trains and test_hf_deepseek_qwen3 converts.

Worker side: Megatron models inside the gloo pools. Pytest side: the conversions and checks
more than one of those modules runs."""

from __future__ import annotations

import shlex
from typing import List

import torch

from megatron.fsdp.commands import PRETRAIN
from megatron.fsdp_training.tools.checkpoint_tools import convert, hf_convert
from megatron.fsdp_training.tools.checkpoint_tools.hf_io import SafetensorsReader


# Every piece of DeepSeek-V3's shape at the smallest size that still exercises it: multi-latent
# attention (low-rank query and key/value projections with their norms, YaRN RoPE on a separate
# head part), one multi-token prediction layer, a dense first layer then MoE, 8 experts with one
# shared expert, sigmoid routing with the learned expert bias, group-limited top-2 (2 of 4
# groups), a top-k scaling factor, the sequence-level auxiliary loss. No dropout, so runs on
# other layouts match.
DEEPSEEK_MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "10",
    "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
    "--mock-data", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1", "--seed", "7",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--qk-layernorm",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
    "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "40", "--mscale", "1.0",
    "--mscale-all-dim", "1.0",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
    "--num-experts", "8", "--moe-layer-freq", "[0]*1+[1]*1", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
]

ZERO3 = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


@torch.no_grad()
def megatron_logits(ctx, argv: List[str], model_file: str, tokens: torch.Tensor) -> dict:
    """Logits of the single-rank (TP 1) GPTModel of ``argv`` holding ``model_file`` (``to-torch --model-only``).

    Every rank builds the same model by itself (data parallel only: no collective in the forward).
    """
    from megatron.core import parallel_state as ps
    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.arguments import parse_args, validate_args
    from megatron.fsdp_training.testing.megatron_case import megatron_case

    state = torch.load(model_file, weights_only=False)
    vocab = state["embedding.word_embeddings.weight"].shape[0]
    with megatron_case():
        args = validate_args(parse_args(argv), ctx.size)
        ps.initialize_model_parallel()
        enable_cpu_mode(args.seed)
        config = model_lib.transformer_config(args, cpu=True)
        model = model_lib.build_model_chunks(config, model_lib.ModelBuildConfig.from_args(args, cpu=True), vocab)[0]
        result = model.load_state_dict(state, strict=False)
        model.eval()
        seq = tokens.shape[1]
        positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        logits = model(tokens, positions, mask)
    return {"logits": logits if ctx.rank == 0 else None,
            "missing": [k for k in result.missing_keys if not k.endswith("_extra_state")],
            "unexpected": list(result.unexpected_keys)}


def finetune_first_batch(ctx, argv: List[str]) -> dict:
    """``pretrain`` of ``argv`` (``--load ... --finetune``), and the first global batch it trained on."""
    from megatron.fsdp_training.data import datasets as data
    from megatron.fsdp_training.data.data_config import DataConfig
    from megatron.fsdp_training.arguments import parse_args, validate_args
    from megatron.fsdp_training.testing.pretrain import pretrain_in_pool

    history = pretrain_in_pool(ctx, argv)
    args = validate_args(parse_args(argv), ctx.size)
    config = DataConfig.from_args(args)
    train, _, _ = data.build_datasets(config, data.build_tokenizer(config.tokenizer))
    rows = [train[i] for i in range(args.global_batch_size)]
    batch = {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in ("tokens", "labels", "loss_mask")}
    return {"losses": history["losses"], "start_iteration": history["start_iteration"], **batch}


def megatron_logits_of_each(ctx, cases: List[dict]) -> List[dict]:
    """``megatron_logits`` of several models in one call (``cases``: its keyword arguments, one dict each)."""
    return [megatron_logits(ctx, **case) for case in cases]


# Pytest side

def tensors(directory):
    """Every tensor of the safetensors files in ``directory``, by name."""
    reader = SafetensorsReader(directory)
    return {k: reader.read(k) for k in reader.entries}


def finetune_from_hf(pool, hf, hf_dir, ckpt, capsys, iterations):
    """``convert.py from-hf`` of ``hf`` (saved in ``hf_dir``), then the command it prints at ZeRO-3 on the
    pool: (that command, what ``finetune_first_batch`` returned, the HF model's loss on the first batch),
    the first iteration's loss checked equal to HF's (1e-5 relative)."""
    convert.main(["from-hf", str(hf_dir), str(ckpt)])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("train from it with: "))
    command = shlex.split(line[len("train from it with: "):])
    assert command[:4] == [PRETRAIN, "--load", str(ckpt), "--finetune"]
    argv = command[1:] + ["--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters",
                          str(iterations), "--lr", "1e-2", "--eval-iters", "1", "--seed", "5"] + ZERO3
    got = pool.run(finetune_first_batch, timeout=300, argv=argv)[0]
    assert got["start_iteration"] == 0 and bool(got["loss_mask"].all())
    with torch.no_grad():
        logits = hf(got["tokens"]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), got["labels"].reshape(-1))
    assert abs(got["losses"][0] - loss.item()) <= 1e-5 * loss.item(), (got["losses"], loss.item())
    return command, got, loss.item()


def from_hf_with_flags(model, tmp_path, name, expected_flags, pre_softmax):
    """``model`` saved in ``tmp_path/name`` -> from-hf into ``tmp_path/name-ckpt``: the printed flags hold
    ``expected_flags``, and ``--moe-router-pre-softmax`` exactly when ``pre_softmax``."""
    model.save_pretrained(tmp_path / name)
    report, arch = hf_convert.from_hf(str(tmp_path / name), str(tmp_path / f"{name}-ckpt"))
    flags = arch.megatron_flags()
    assert all(f in flags for f in expected_flags), (name, flags)
    assert ("--moe-router-pre-softmax" in flags) == pre_softmax, flags
    return report, arch, flags


def exported_again_equals(model, ckpt, out, tokens):
    """to-hf of ``ckpt`` (from-hf of ``model``) into ``out``: transformers loads it with no key missing,
    unexpected or mismatched, every tensor is ``model``'s bitwise and so are the logits; returns the tensors."""
    from transformers import AutoModelForCausalLM

    hf_convert.to_hf(str(ckpt), str(out))
    again, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (out, info)
    state, loaded = model.state_dict(), again.state_dict()
    assert sorted(loaded) == sorted(state) and all(torch.equal(loaded[k], state[k]) for k in state), out
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, again.eval()(tokens).logits), out
    return tensors(out)
