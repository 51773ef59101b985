"""AutoBridge with a model wrapped by this backend: a tiny random HuggingFace Llama imported, run, exported, for the tests.

    python autobridge_roundtrip.py LEVEL[,LEVEL...] WORKDIR    # under torchrun or fork_launch ("bridge"), gloo

Rank 0 writes the HF model (random init, ``save_pretrained``; nothing is downloaded). Then, as a Bridge user does:
``AutoBridge.from_hf_pretrained`` -> ``to_megatron_provider(load_weights=True)`` (the weights go in before wrapping)
-> ``provide_distributed_model`` with ``use_megatron_fsdp`` at each LEVEL (this backend, after ``bridge.install()``);
the wrapped model's logits against HF's; ``export_hf_weights`` against HF's tensors; and ``load_hf_weights`` into a
second, already wrapped model (random weights) whose logits must become HF's. Rank 0 writes ``WORKDIR/result.json``
(``{level: result}``).
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def tiny_llama(directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(directory)


def provider(auto_bridge, load_weights: bool):
    from megatron.fsdp.mcore_cpu.layer_spec import cpu_layer_spec

    p = auto_bridge.to_megatron_provider(load_weights=load_weights)
    p.transformer_layer_spec, p.use_cpu_initialization = cpu_layer_spec, True
    p.params_dtype = p.pipeline_dtype = torch.float32
    p.bf16 = p.fp16 = False
    for fusion in ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
                   "gradient_accumulation_fusion", "apply_rope_fusion", "cross_entropy_loss_fusion"):
        setattr(p, fusion, False)
    p.attention_dropout = p.hidden_dropout = 0.0
    p.finalize()
    return p


def main(levels: str, workdir: str) -> None:
    dist.init_process_group("gloo")
    hf_dir = os.path.join(workdir, "hf")
    if dist.get_rank() == 0:
        tiny_llama(hf_dir)
    dist.barrier()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(create_gloo_process_groups=True)
    from megatron.fsdp.mcore import bridge
    from megatron.fsdp.mcore_cpu.cuda_standins import enable_cpu_mode

    bridge.install()
    enable_cpu_mode(1234)
    from megatron.bridge import AutoBridge
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    auto = AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.float32)

    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    results = {level: round_trip(auto, hf, level, tokens, positions) for level in levels.split(",")}
    if dist.get_rank() == 0:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()


def round_trip(auto, hf, level: str, tokens, positions) -> dict:
    from megatron.bridge.training.config import DistributedDataParallelConfig

    def wrapped(load_weights: bool):
        ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=level,
                                            use_distributed_optimizer=True)
        ddp.finalize()
        return provider(auto, load_weights).provide_distributed_model(
            wrap_with_ddp=True, ddp_config=ddp, use_megatron_fsdp=True, mixed_precision_wrapper=None)

    def logits_gap(model) -> float:
        model[0].eval()
        with torch.no_grad():
            ours = model[0](tokens, positions, None)
            return float((ours.float() - hf(tokens).logits).abs().max())

    model = wrapped(load_weights=True)
    result = {"wrapper": type(model[0]).__module__ + "." + type(model[0]).__name__, "logits_gap": logits_gap(model)}
    reference = hf.state_dict()
    exported = {name: tensor for name, tensor in auto.export_hf_weights(model, cpu=True)}
    result["exported"] = sorted(exported)
    result["expected"] = sorted(k for k in reference if not k.endswith("rotary_emb.inv_freq"))
    result["empty"] = sorted(k for k, v in exported.items() if v.numel() == 0)
    result["export_gap"] = max(float((v.float() - reference[k].float()).abs().max()) for k, v in exported.items()
                               if v.numel() == reference[k].numel())
    fresh = wrapped(load_weights=False)
    result["fresh_logits_gap"] = logits_gap(fresh)
    auto.load_hf_weights(fresh)
    result["imported_logits_gap"] = logits_gap(fresh)
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
