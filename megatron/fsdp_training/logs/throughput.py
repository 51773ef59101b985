"""``--log-throughput``: Megatron-LM's model FLOPs per iteration, TFLOP/s per GPU and tokens/s per rank.

The FLOP count is Megatron-LM's ``num_floating_point_operations`` for a standard
transformer (``megatron/fsdp_training/training.py``), written from its definition
(Narayanan et al. 2021, appendix "Floating-point operations"):

* every GEMM runs three times (forward, weight gradient, input gradient) and costs
  ``2 m n k``; attention and the MLP each hold two GEMMs of a size: ``12 = 3 x 2 x 2``;
* attention per layer and token: ``12 h^2 (1 + g / a + s / (2 h)) q / h`` with ``g`` key/value
  groups (GQA; ``g = a`` without it), ``a`` heads, ``q = kv_channels x a`` the query projection
  size, and ``s / 2`` because a causal score matrix is half non-zero;
* MLP per layer and token: ``12 h f m`` with ``m = 3/2`` under SwiGLU (three matrices, not two),
  ``f`` the FFN size of dense layers, ``topk x moe_ffn`` for the routed experts plus the shared
  expert size for MoE layers (``--moe-layer-freq`` says which layers are which);
* the output layer: ``6 h V`` (``V`` the padded vocabulary).

Recomputation is not counted (Megatron-LM counts model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from typing import List, Tuple

from dataclasses import dataclass

from .model_size import ModelSize


def num_floating_point_operations(size: ModelSize, batch_size: int) -> float:
    """Model FLOPs of one training iteration over ``batch_size`` sequences (forward and backward)."""
    h, s, layers = size.hidden_size, size.seq_length, size.num_layers
    heads = size.num_attention_heads
    groups = size.query_groups
    query_ratio = size.kv_channels * heads / h
    gated = 1.5 if size.swiglu else 1.0
    moe_layers, topk = size.moe_layers, size.moe_router_topk
    moe_ffn, shared = size.moe_ffn_hidden_size, size.moe_shared_expert_size
    dense_layers = layers - moe_layers
    mlp = 12 * h * gated * (size.ffn_hidden_size * dense_layers + (moe_ffn * topk + shared) * moe_layers)
    attention = 12 * layers * h * h * (1 + groups / heads + s / h / 2) * query_ratio
    logits = 6 * h * size.padded_vocab_size
    return float(batch_size * s * (mlp + attention + logits))


@dataclass(frozen=True)
class Throughput:
    """One iteration's rates: model TFLOP/s per GPU (rank) and tokens per second per rank."""

    tflops_per_gpu: float
    tokens_per_second_per_rank: float

    def log_fields(self) -> List[Tuple[str, str]]:
        """The (name, value) fields of Megatron-LM's iteration line (after the elapsed time), plus tokens/s."""
        return [("throughput per GPU (TFLOP/s/GPU)", f"{self.tflops_per_gpu:.1f}"),
                ("tokens per second per rank", f"{self.tokens_per_second_per_rank:.1f}")]


def throughput(size: ModelSize, elapsed_seconds: float, world_size: int, batch: int) -> Throughput:
    """Rates of one iteration of ``batch`` sequences (``--global-batch-size``, smaller during
    ``--rampup-batch-size``) that took ``elapsed_seconds``."""
    elapsed = max(elapsed_seconds, 1e-12)
    flops = num_floating_point_operations(size, batch)
    tokens = batch * size.seq_length
    return Throughput(flops / (elapsed * 1e12 * world_size), tokens / elapsed / world_size)
