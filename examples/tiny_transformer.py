"""Train a tiny decoder-only transformer with Megatron-FSDP on synthetic data.

Single process:   python examples/tiny_transformer.py
Four processes:   torchrun --nproc_per_node 4 examples/tiny_transformer.py

Torch only (CPU + gloo is enough). The data is a fixed random token pattern
repeated forever, so the model can learn it and the loss visibly falls.
"""

import argparse
import contextlib
import math
import os
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import megatron.fsdp as mfsdp  # noqa: E402


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Token + position embedding, `layers` Blocks, final LayerNorm, output head tied to the embedding."""

    def __init__(self, vocab, hidden, layers, heads, seq_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens):
        """tokens: [batch, seq_len + 1] int64. Returns the mean next-token cross-entropy."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        x = self.embed(inputs) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.embed.weight)  # tied output head
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def global_batch(step, batch_size, seq_len, pattern):
    """Deterministic batch for `step`: windows of the repeated pattern at random offsets."""
    g = torch.Generator().manual_seed(1000 + step)
    offsets = torch.randint(0, pattern.numel(), (batch_size, 1), generator=g)
    idx = (offsets + torch.arange(seq_len + 1)) % pattern.numel()
    return pattern[idx]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--bf16", action="store_true", help="bf16 compute weights, fp32 main weights and grad reduction")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(args.seed)  # identical initialisation on every rank
    model = TinyTransformer(args.vocab, args.hidden, args.layers, args.heads, args.seq_len)
    num_params = sum(p.numel() for p in model.parameters())
    mp = None
    if args.bf16:
        mp = mfsdp.MixedPrecision(param_dtype=torch.bfloat16, main_dtype=torch.float32,
                                  grad_reduce_dtype=torch.float32)
    model = mfsdp.fully_shard(model, strategy=args.strategy, unit_modules=(Block,), mixed_precision=mp)
    optimizer = mfsdp.FullyShardedOptimizer(model, torch.optim.AdamW, lr=args.lr,
                                            weight_decay=0.1, clip_grad=1.0)

    pattern = torch.randint(0, args.vocab, (3 * args.seq_len,), generator=torch.Generator().manual_seed(args.seed))
    per_rank = args.micro_batches * args.micro_batch_size
    if rank == 0:
        print(f"strategy={args.strategy} world={world} global batch={per_rank * world} bf16={args.bf16} "
              f"params={num_params}",
              flush=True)

    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        batch = global_batch(step, per_rank * world, args.seq_len, pattern)
        local = batch[rank * per_rank:(rank + 1) * per_rank].split(args.micro_batch_size)
        total_loss = torch.zeros(())
        for k in range(args.micro_batches):
            last = k == args.micro_batches - 1
            with (contextlib.nullcontext() if last else model.no_sync()):
                loss = model(local[k]) / args.micro_batches
                loss.backward()
            total_loss += loss.detach().float()
        grad_norm = optimizer.step()
        optimizer.zero_grad()
        if distributed:
            dist.all_reduce(total_loss)  # gloo has no AVG; sum then divide
            total_loss /= world
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if rank == 0:
            print(f" iteration {step:8d}/{args.steps:8d} | lm loss: {total_loss.item():.6E} | "
                  f"grad norm: {float(grad_norm):.3f} | elapsed time per iteration (ms): {elapsed_ms:.1f} |",
                  flush=True)

    if distributed:
        mfsdp.shutdown()  # the weight install gathers of the last step are still in flight
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
