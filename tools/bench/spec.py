"""What the benchmark runs: model sizes, systems, and the theoretical minimum of each system.

Kept apart from the workers and the report so the orchestrator, the worker processes and
the test all read one definition. The theory here is the yardstick for the "vs theory"
columns; docs/performance.md explains it in prose.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

from tools.fsdp_planner import QUANTIZED_GATHER_BYTES  # bytes per quantized element per recipe: one definition

LEVELS = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OURS = tuple(f"ours:{level}" for level in LEVELS)
# The engine options the training job's two flags turn on, as rows of their own at ZeRO-3:
# ``--grad-reduce-in-bf16`` (gradients reduced in bf16: MixedPrecision(grad_reduce_dtype=bf16),
# half the reduce-scatter bytes) and ``--fsdp-double-buffer`` (fully_shard(overlap=Overlap(double_buffer=True)):
# persistent gather buffers). ``ours:<level>+<option>``.
OPTIONS = ("bf16_reduce", "double_buffer")
OURS_OPTIONS = tuple(f"ours:optim_grads_params+{option}" for option in OPTIONS)
# The quantized parameter gather at ZeRO-3 (MixedPrecision(param_gather=QuantizedParamGather(...)), the job's
# ``--fp8-param-gather``), bf16 compute: the default selection, every trainable nn.Linear weight (the blocks'
# qkv, proj, fc1, fc2; the root's embeddings, norms and tied head stay bf16). ``fp8_gather``: per-tensor FP8
# under "delayed" with history 1, most_recent: Megatron-LM's defaults (--fp8-recipe delayed,
# --fp8-amax-history-len 1, --fp8-amax-compute-algo most_recent), which the job keeps; on the wire it is
# tensorwise (the same bytes, the same batched amax all-reduce per unit per step) plus the history's
# bookkeeping. ``mxfp8_gather``: --fp8-recipe mxfp8 (32-blocks, E8M0 scales, no all-reduce).
GATHER_RECIPES = {"fp8_gather": "delayed", "mxfp8_gather": "mxfp8"}
FP8_OPTIONS = tuple(GATHER_RECIPES)
OURS_FP8 = tuple(f"ours:optim_grads_params+{option}" for option in FP8_OPTIONS)
ENGINE_ROWS = OURS + OURS_OPTIONS + OURS_FP8  # every row of this project's engine (ledger bytes)

# NVIDIA's standalone megatron-fsdp package (its own ``fully_shard``), at ZeRO-3 and ZeRO-2.
NV_FSDP = ("nv_fsdp:optim_grads_params", "nv_fsdp:optim_grads")

# Systems per workload; "unwrapped" runs only at world size 1, where it is the yardstick
# for the engine's overhead; "floor" only at world sizes above 1, where it is the
# yardstick for every system: the unwrapped model on every rank at once, the same
# per-rank batch and optimizer, no collectives (the no-communication limit).
SYSTEMS = {
    "torch": ("unwrapped",) + ENGINE_ROWS + ("fsdp2",) + NV_FSDP + ("floor",),
    "mcore": OURS + OURS_OPTIONS + ("mcore_ddp", "mcore_distopt", "mfsdp_v1", "floor"),
}
PEERS = {"torch": ("fsdp2", "unwrapped"), "mcore": ("mcore_ddp", "mcore_distopt", "mfsdp_v1")}
FLOOR = "floor"
PEAK_TARGET = 0.92  # ours ZeRO-3 (fp32 state) / FSDP2 peak memory at 70M, every world size
LABELS = {"unwrapped": "unwrapped", "floor": "floor (no comm)", "fsdp2": "FSDP2", "mcore_ddp": "MCore DDP",
          "mcore_distopt": "MCore DistOpt", "mfsdp_v1": "M-FSDP v1",
          "nv_fsdp:optim_grads_params": "megatron-fsdp ZeRO-3", "nv_fsdp:optim_grads": "megatron-fsdp ZeRO-2",
          **{f"ours:{level}": f"ours {level}" for level in LEVELS},
          **{system: "ours ZeRO-3+" + system.partition("+")[2].replace("_", " ").replace("buffer", "buf")
              for system in OURS_OPTIONS},
          "ours:optim_grads_params+fp8_gather": "ours ZeRO-3+FP8 gather",
          "ours:optim_grads_params+mxfp8_gather": "ours ZeRO-3+MXFP8 gather"}

# The level each peer corresponds to, for the byte and memory formulas.
LEVEL_OF = {**{f"ours:{level}": level for level in LEVELS}, "mcore_ddp": "no_shard",
            "mcore_distopt": "optim", "mfsdp_v1": "optim_grads_params", "fsdp2": "optim_grads_params",
            **{system: system.partition(":")[2] for system in NV_FSDP},
            **{system: system.partition(":")[2].partition("+")[0] for system in OURS_OPTIONS + OURS_FP8}}

# ZeRO-3 systems that keep the unit whose forward ends last (the last block) gathered from its forward
# into the backward, which starts with it: this project (megatron/fsdp/schedule/runtime.py) and FSDP2
# set up as torchtitan sets it up (``reshard_after_forward=False`` on the last block). Megatron-FSDP v1
# and megatron-fsdp release it after its forward and gather it again.
HOLDS_LAST_UNIT = frozenset(ENGINE_ROWS + ("fsdp2",))


def option_of(system: str) -> str:
    """The engine option of an ``ours:<level>+<option>`` row ("" for none)."""
    return system.partition("+")[2]


def gather_recipe_of(system: str) -> Optional[str]:
    """The ``QuantizedParamGather`` recipe of an FP8 gather row, or None."""
    return GATHER_RECIPES.get(option_of(system))


def reduce_bytes_of(system: str) -> int:
    """Bytes per gradient element on the wire: 2 where the row reduces in bf16, else 4 (fp32)."""
    return 2 if option_of(system) == "bf16_reduce" else 4


def runs_at(system: str, ranks: int) -> bool:
    """Whether ``system`` has a row at world size ``ranks`` (the two yardsticks are one-sided)."""
    if system == "unwrapped":
        return ranks == 1
    return ranks > 1 or system.startswith("ours:")


@dataclasses.dataclass(frozen=True)
class Size:
    """A GPT shape: the torch model and Megatron-Core's GPTModel are built from the same one."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    seq: int
    rows: int  # sequences per rank per step (one micro-batch)


SIZES = {
    "tiny": Size(vocab=256, hidden=64, layers=2, heads=4, seq=32, rows=2),  # --quick
    "5M": Size(vocab=1024, hidden=256, layers=6, heads=4, seq=256, rows=2),
    "50M": Size(vocab=4096, hidden=512, layers=15, heads=8, seq=256, rows=2),
    "70M": Size(vocab=4096, hidden=512, layers=21, heads=8, seq=256, rows=2),  # tools/bench/memory.py
    # Beyond the benchmark's own two: where each cost grows differently.
    "root-heavy": Size(vocab=16384, hidden=512, layers=2, heads=8, seq=256, rows=2),  # embeddings > blocks
    "deep-narrow": Size(vocab=1024, hidden=256, layers=32, heads=4, seq=256, rows=2),  # many small units
    "200M": Size(vocab=8192, hidden=1024, layers=16, heads=16, seq=256, rows=2),  # parameters over activations
}
LR, BETAS, EPS, WEIGHT_DECAY, CLIP_GRAD = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """A workload's parameter counts the byte formulas read (a worker reports each under its field's name):
    all of them, the root unit's, the last unit's, and of those the weights gathered quantized
    (``torch_case.quantized_counts``) and their tensor count."""

    params: int
    root_params: int
    last_unit_params: int = 0
    quantized_params: int = 0
    last_unit_quantized: int = 0
    quantized_tensors: int = 0


def theory_bytes(system: str, counts: ParamCounts, world: int, compute_bytes: int,
                 reduce_bytes: int = 4) -> Dict[str, int]:
    """Minimum bytes per collective kind for one step of one micro-batch (ledger convention).

    Bytes are those of the full buffer a collective works on. Gradients are reduced once
    in ``reduce_bytes`` (fp32); weights are gathered in the compute dtype: under ZeRO-1/2
    once after the optimizer step, under ZeRO-3 before forward and again before backward,
    except the root's parameters (embeddings, final norm), which stay gathered from the
    forward through the backward (as in FSDP2), and, for the systems in ``HOLDS_LAST_UNIT``,
    the ``last_unit_params`` of the unit the backward starts with (steady state: from the
    second step on). The scalar all-reduce of the gradient norm is left out (8 bytes).

    FP8 gather rows (``OURS_FP8``): of the gathered elements, the ``quantized_params`` weights
    (``last_unit_quantized`` of them in the held unit) travel at ``QUANTIZED_GATHER_BYTES`` of
    the recipe (1 byte; MXFP8 1 + 1/32 with its E8M0 block scales), the rest in the compute
    dtype; the per-tensor recipes add one all-reduce MAX of the ``quantized_tensors`` fp32
    amaxes per step (each unit's, batched, when the new weights are installed). Layout and
    wire alignment padding are left out (the "vs theory" column shows them).
    """
    level = LEVEL_OF.get(system)
    if world == 1 or level is None:
        return {}
    params, root_params = counts.params, counts.root_params
    grads = reduce_bytes * params
    if level == "no_shard":
        return {"all_reduce": grads}
    if level in ("optim", "optim_grads"):
        return {"reduce_scatter": grads, "all_gather": compute_bytes * params}
    held = counts.last_unit_params if system in HOLDS_LAST_UNIT else 0
    out = {"reduce_scatter": grads, "all_gather": compute_bytes * (2 * params - root_params - held)}
    recipe = gather_recipe_of(system)
    if recipe is not None:
        held_quantized = counts.last_unit_quantized if held else 0
        saved = (compute_bytes - QUANTIZED_GATHER_BYTES[recipe]) * (2 * counts.quantized_params - held_quantized)
        out["all_gather"] = round(out["all_gather"] - saved)
        if recipe != "mxfp8":
            out["all_reduce"] = 4 * counts.quantized_tensors
    return out


def theory_persistent(system: str, params: int, world: int, compute_bytes: int,
                      gather_buffer_params: int = 0) -> Optional[float]:
    """Persistent bytes per rank between steps, with Adam (two fp32 moments) and no padding.

    This project: the table of docs/engine.md between steps (the gradient accumulators are
    released by ``zero_grad()``; fp32 main weights only when compute is not fp32; under
    ZeRO-3 with bf16 compute no compute weights at all: each gather casts the main shard).
    ``+double_buffer`` keeps its persistent gather buffers besides, ``gather_buffer_params``
    elements in the compute dtype (``gather_buffer_elements``). Megatron-Core's DDP and DistributedOptimizer keep their fp32 grad buffers at the
    ``no_shard``/``optim`` levels, and Megatron-FSDP v1 at ``optim_grads_params``. FSDP2 and
    the unwrapped model free their gradients in ``zero_grad`` and keep fp32 parameters
    (sharded for FSDP2) and Adam state.
    """
    n, psi, c = world, params, compute_bytes
    m = 4 if c != 4 else 0
    if system in ("unwrapped", FLOOR):  # under bf16 the floor also keeps its bf16 model (Megatron's recipe)
        return 12.0 * psi + (c * psi if m and system == FLOOR else 0.0)
    if system == "fsdp2":
        return 12.0 * psi / n
    level = LEVEL_OF[system]
    compute = c * psi / n if level == "optim_grads_params" else c * psi
    if level == "optim_grads_params" and m and n > 1 and system.startswith("ours:"):
        compute = 0.0  # each gather casts the fp32 main shard: no compute copy between uses
    grads = 4 * psi / n if level in ("optim_grads", "optim_grads_params") else 4 * psi
    if system.startswith("ours:"):
        grads = 0.0  # released by zero_grad (set_to_none), allocated again by the next backward
    if option_of(system) == "double_buffer" and n > 1:
        compute += c * gather_buffer_params
    sharded = level != "no_shard"
    return compute + grads + (m * psi + 8 * psi) / (n if sharded else 1)


def gather_buffer_elements(unit_params, depth: int = 1) -> int:
    """Elements of ``double_buffer``'s persistent buffers for units of ``unit_params`` parameters,
    the root first, then the layers in order (all at one nesting depth): the root one buffer of its
    own, the layers ``max(2, depth + 1)`` buffers as large as the largest (gather_buffers.plan)."""
    root, *layers = unit_params
    return root + (max(2, depth + 1) * max(layers) if layers else 0)
