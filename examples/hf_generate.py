"""Train and generate with a Hugging Face model sharded at ZeRO-3: transformers' own generate() on the wrapped model.

Two processes:   torchrun --nproc_per_node 2 examples/hf_generate.py

A tiny Llama built from its config (no download), wrapped with ``fully_shard`` one unit per decoder
layer, trains a few steps; then ``model.module.generate()`` continues two prompts greedily, and the
script checks the tokens against the same weights unsharded and that nothing stays gathered.
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

import megatron.fsdp as mfsdp  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = mfsdp.fully_shard(LlamaForCausalLM(config), strategy="optim_grads_params",
                              unit_modules=(LlamaDecoderLayer,))
    optimizer = mfsdp.FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    data = torch.randint(0, config.vocab_size, (4 * world, 16), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        ids = data[rank * 4:(rank + 1) * 4]  # this rank's part of the global batch
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} | loss {loss.item():.4f}")

    model.eval()
    prompt = data[:2, :4]
    tokens = model.module.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)  # every rank calls it
    gathered = [u.name for u in model.units if u.storage.releases and u.storage.resident]

    reference = LlamaForCausalLM(config).eval()  # the same weights, unsharded
    reference.load_state_dict(model.full_state_dict(), strict=False)
    expected = reference.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    if rank == 0:
        print(f"generated {tokens[:, 4:].tolist()}")
        print(f"unsharded {expected[:, 4:].tolist()}")
    assert torch.equal(tokens, expected), "the sharded model generated other tokens than the unsharded one"
    assert not gathered, f"units still gathered after generate(): {gathered}"
    mfsdp.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
