"""Tiny models for the engine tests: every feature a real model throws at FSDP.

``TinyLM``: tied embedding/output head, a frozen parameter, a registered buffer,
a parameter that never receives a gradient, nested units (``Block`` holds an
``MLP`` unit), optional activation recompute, and sizes no world size divides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 3 * hidden)
        self.down = nn.Linear(3 * hidden, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, recompute: bool):
        super().__init__()
        self.heads = heads
        self.recompute = recompute
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)  # a key bias has a zero gradient in exact math: Adam would amplify noise
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.unused = nn.Parameter(torch.randn(5))  # never touched: gets no gradient

    def _attention(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = x + self._attention(x)
        norm = self.norm2(x)
        mlp = checkpoint(self.mlp, norm, use_reentrant=False) if self.recompute else self.mlp(norm)
        return x + mlp


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 67, hidden: int = 32, heads: int = 4, layers: int = 2,
                 seq: int = 8, recompute: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.frozen_scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.register_buffer("causal_offset", torch.zeros(1))
        self.blocks = nn.ModuleList(Block(hidden, heads, recompute) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) * self.frozen_scale + self.causal_offset.to(x.dtype)
        logits = F.linear(x, self.embed.weight)  # tied with the embedding
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(steps: int, micro_batches: int, global_micro_batch: int, seq: int = 8, vocab: int = 67, seed: int = 1234):
    """Deterministic token batches: ``[step][micro_batch] -> (tokens, targets)`` over the global batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro_batches):
            data = torch.randint(0, vocab, (global_micro_batch, seq + 1), generator=g)
            step.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
        out.append(step)
    return out


class ResetBlock(Block):
    """``Block`` without its constructor-drawn parameter: everything initialises through ``reset_parameters``."""

    def __init__(self, hidden: int, heads: int, recompute: bool = False):
        nn.Module.__init__(self)
        self.heads, self.recompute = heads, recompute
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
