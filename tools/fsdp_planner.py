"""Sharding planner: per-rank memory and per-step traffic of every level pair, before launching a job.

Choosing ``--data-parallel-sharding-strategy`` / ``--outer-dp-sharding-strategy`` by trial
costs a cluster allocation per try; the engine's memory and traffic are closed-form
(docs/engine.md, docs/mesh.md), so they can be tabulated up front. This tool lists every
flat level over all ``N x M`` ranks and every valid ``(inner, outer)`` pair on the
``N x M`` mesh, with persistent memory by kind, the bytes each axis sends, an estimated
communication time, and whether it fits; then it recommends one.

    python tools/fsdp_planner.py --params 7e9 --gpus-per-domain 8 --domains 2 --memory-gb 80

The model (``plan``, ``recommend``, ``gpt_param_count``) is pure and importable; printing
lives in ``format_table`` and ``main``. GB means 1e9 bytes and GB/s 1e9 bytes per second,
as in the design notes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import List, Optional, Sequence, Tuple

# Run as a script, the repository root is not on sys.path; ``megatron`` is a namespace
# package shared with megatron-core, so the checkout's ``megatron/fsdp`` must be found first.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.fsdp.sharding.strategy import NO_SHARD, STRATEGIES, MeshStrategy, ShardingStrategy, valid_pairs

GB = 1e9
ALIASES = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}
NAMED_PAIRS = {("optim_grads_params", "no_shard"): "HSDP", ("optim_grads_params", "optim"): "HFSDP"}
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# bytes per weight element on the wire of a quantized gather (megatron/fsdp/precision/param_gather.py's recipes);
# the one definition: the benchmark's theory (tools/bench/spec.py) imports it
QUANTIZED_GATHER_BYTES = {"tensorwise": 1.0, "delayed": 1.0, "mxfp8": 1.0 + 1.0 / 32}
ADAM_STATE_BYTES = {"fp32": 8.0, "bf16": 4.0}  # two moments per parameter


# ----------------------------------------------------------------------------- inputs

@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of persistent state, and of gradients on the wire.

    The defaults are the design notes' 16 bytes: bf16 weights (2) and gradients (2),
    fp32 main weights (4) and two fp32 Adam moments (8). This engine accumulates
    gradients in fp32 (``grad=4``) and reduces them in fp32 (``reduce=4``) unless told
    otherwise; an fp32 model keeps no separate main copy (``main=0``, ``param=4``).
    ``reduce=None`` means gradients travel in their accumulation precision.
    ``param`` is persistent only where a level keeps compute weights: with separate main
    weights (``main > 0``) ZeRO-3 keeps none (``casts_main_at_gather``). bf16 Adam moments
    (``OptimizerPrecision(torch.bfloat16, torch.bfloat16)``) are ``optim=4``.
    """

    param: float = 2.0
    main: float = 4.0
    grad: float = 2.0
    optim: float = 8.0
    reduce: Optional[float] = None
    gather: Optional[float] = None

    @property
    def wire(self) -> float:
        return self.grad if self.reduce is None else self.reduce

    @property
    def gather_wire(self) -> float:
        """Bytes per element of ZeRO-3's weight gathers: the compute dtype, or the quantized gather's."""
        return self.param if self.gather is None else self.gather

    @property
    def total(self) -> float:
        return self.param + self.main + self.grad + self.optim


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    params: float  # Ψ: every parameter counted as trainable and as one data-parallel pool
    bytes: StateBytes = StateBytes()


@dataclasses.dataclass(frozen=True)
class Topology:
    """``N`` ranks per NVLink domain, ``M`` domains; bandwidths per rank, in GB/s.

    ``inter_bw`` is what one rank's own network port carries (one NIC per GPU, as on
    DGX/HGX nodes); ``intra_bw`` what one rank's NVLink carries.
    """

    gpus_per_domain: int
    domains: int
    intra_bw: float = 450.0  # DGX H100 NVLink, one direction (design notes)
    inter_bw: float = 50.0   # 400 Gb/s NIC per GPU

    @property
    def ranks(self) -> int:
        return self.gpus_per_domain * self.domains

    def flat_bandwidth(self) -> float:
        """Bus bandwidth (GB/s) of one ring over all ``N x M`` ranks.

        Within one domain it is NVLink. Across domains NCCL runs one ring per NIC,
        each crossing every domain boundary once: a rank sends ``1/N`` of its ring
        traffic over its NIC and ``(N-1)/N`` over NVLink, concurrently, so the ring
        moves at ``min(N/(N-1) * intra, N * inter)``.
        """
        n = self.gpus_per_domain
        if self.domains == 1:
            return self.intra_bw
        if n == 1:
            return self.inter_bw
        return min(n / (n - 1) * self.intra_bw, n * self.inter_bw)


@dataclasses.dataclass(frozen=True)
class Budget:
    memory_gb: float
    micro_batches: int = 1


# ----------------------------------------------------------------------------- outputs

@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per rank by kind at the optimizer step (what ``model.memory_report`` measures then).

    ``total`` is what must fit: at the step every kind is alive. Gradients are held only from
    a unit's first reduction to ``optimizer.zero_grad()``, which releases them (set_to_none),
    so between steps a rank holds ``between_steps`` (the forward's activations come on top
    of that, the step's gradients do not).
    """

    params: float
    main: float
    grads: float
    optim: float

    @property
    def total(self) -> float:
        return self.params + self.main + self.grads + self.optim

    @property
    def between_steps(self) -> float:
        return self.params + self.main + self.optim


@dataclasses.dataclass(frozen=True)
class Collectives:
    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    all_reduce: float = 0.0

    @property
    def total(self) -> float:
        return self.all_gather + self.reduce_scatter + self.all_reduce


@dataclasses.dataclass(frozen=True)
class AxisTraffic:
    """One axis over one optimizer step.

    ``ledger``: full-buffer bytes per kind, as ``model.ledger.bytes(kind, axis)``
    counts them; ``sent``: bytes one rank sends under the ring algorithm
    (``(p-1)/p`` of the buffer for all-gather and reduce-scatter, twice that for
    all-reduce); ``seconds``: ``sent`` over ``bandwidth`` (GB/s).
    """

    size: int
    bandwidth: float
    ledger: Collectives
    sent: Collectives
    seconds: float


@dataclasses.dataclass(frozen=True)
class PlanRow:
    name: str
    mesh: str
    inner: str
    outer: Optional[str]  # None: a flat mesh (one axis of N x M ranks)
    memory: Memory
    inner_axis: AxisTraffic
    outer_axis: AxisTraffic
    comm_seconds: float
    fits: bool


@dataclasses.dataclass(frozen=True)
class Recommendation:
    row: PlanRow
    reason: str


class NothingFits(ValueError):
    """No configuration fits the memory budget; the message says how close the best one is."""


# ----------------------------------------------------------------------------- model

def _split(shard_inner: bool, shard_outer: bool, n: int, m: int) -> int:
    return (n if shard_inner else 1) * (m if shard_outer else 1)


def casts_main_at_gather(levels: MeshStrategy, n: int, m: int, b: StateBytes) -> bool:
    """ZeRO-3 with separate main weights keeps no compute copy: each gather casts the main shard.

    As ``buffers.UnitStorage.casts_main``: the inner level shards parameters on more than one
    rank, and the outer level either shards parameters too or leaves optimizer state whole
    (HFSDP, whose outer level shards optimizer state only, keeps the inner compute shard).
    """
    return (b.main > 0 and levels.inner.shard_params and n * m > 1
            and (levels.outer.shard_params or not levels.outer.shard_optim))


def persistent_memory(levels: MeshStrategy, n: int, m: int, model: ModelSpec) -> Memory:
    """docs/mesh.md's table: each kind lives on the finest range its two levels allow (regions.py)."""
    psi, b = model.params, model.bytes
    optim_split = _split(levels.inner.shard_optim, levels.outer.shard_optim, n, m)
    compute = 0.0 if casts_main_at_gather(levels, n, m, b) else b.param
    return Memory(
        params=compute * psi / _split(levels.inner.shard_params, levels.outer.shard_params, n, m),
        main=b.main * psi / optim_split,
        grads=b.grad * psi / _split(levels.inner.shard_grads, levels.outer.shard_grads, n, m),
        optim=b.optim * psi / optim_split,
    )


def ledger_bytes(levels: MeshStrategy, n: int, m: int, model: ModelSpec, micro_batches: int) -> Tuple[Collectives, Collectives]:
    """Full-buffer bytes per step on the inner and outer axis, following ``buffers.UnitStorage``.

    Assumes Megatron's schedule (``no_sync`` on all but the last micro-batch) and that
    every parameter sits in a unit gathered before forward and again before backward
    (the root unit, gathered once per micro-batch, and the unit the backward starts with,
    which stays gathered from its forward, make the real ZeRO-3 figure a little lower: one
    layer's gathers per micro-batch fewer each). The scalar grad-norm all-reduce is left
    out. An axis of one rank sends nothing.

    * ``unshard`` (ZeRO-3 inner, twice per micro-batch): outer all-gather of the inner
      shard if the outer level shards params, then the inner all-gather of the buffer;
    * ``reduce_microbatch`` (levels that shard grads, every micro-batch): inner
      reduce-scatter of the gradient, outer reduce-scatter of the inner shard;
    * ``reduce_step`` (once per step): the inner all-reduce (no_shard) or reduce-scatter
      (optim) of the accumulator, the outer all-reduce (no_shard) or reduce-scatter
      (optim) of the inner shard;
    * ``install_main_weights`` (once per step): outer all-gather of updated pieces
      (``optim``, ``optim_grads`` outer), inner all-gather (``optim``, ``optim_grads`` inner).
    """
    psi, c, g, k = model.params, model.bytes.param, model.bytes.wire, micro_batches
    inner, outer = levels.inner, levels.outer
    shard = psi / n if inner.shard_optim else psi  # what the outer axis works on: the inner range

    def gathers(level: ShardingStrategy, elements: float) -> float:
        if level.shard_params:
            return 2 * k * model.bytes.gather_wire * elements
        return c * elements if level.shard_optim else 0.0

    def on_axis(level: ShardingStrategy, elements: float) -> Collectives:
        gather = gathers(level, elements)
        if level.shard_grads:
            return Collectives(gather, k * g * elements, 0.0)
        if level.shard_optim:
            return Collectives(gather, g * elements, 0.0)
        return Collectives(gather, 0.0, g * elements)

    empty = Collectives()
    return (on_axis(inner, psi) if n > 1 else empty,
            on_axis(outer, shard) if m > 1 else empty)


def ring_traffic(ledger: Collectives, size: int, bandwidth: float) -> AxisTraffic:
    ring = (size - 1) / size
    sent = Collectives(ring * ledger.all_gather, ring * ledger.reduce_scatter, 2 * ring * ledger.all_reduce)
    return AxisTraffic(size, bandwidth, ledger, sent, sent.total / (bandwidth * GB))


def _row(levels: MeshStrategy, flat: bool, model: ModelSpec, topology: Topology, budget: Budget) -> PlanRow:
    n, m = (topology.ranks, 1) if flat else (topology.gpus_per_domain, topology.domains)
    inner_bw = topology.flat_bandwidth() if flat else topology.intra_bw
    inner_ledger, outer_ledger = ledger_bytes(levels, n, m, model, budget.micro_batches)
    inner_axis = ring_traffic(inner_ledger, n, inner_bw)
    outer_axis = ring_traffic(outer_ledger, m, topology.inter_bw)
    memory = persistent_memory(levels, n, m, model)
    key = (levels.inner.name, levels.outer.name)
    if flat:
        name = ALIASES[levels.inner.name]
    else:
        name = NAMED_PAIRS.get(key, f"{ALIASES[key[0]]} x {ALIASES[key[1]]}")
    return PlanRow(
        name=name, mesh=str(n) if flat else f"{n}x{m}", inner=levels.inner.name,
        outer=None if flat else levels.outer.name, memory=memory, inner_axis=inner_axis,
        outer_axis=outer_axis, comm_seconds=inner_axis.seconds + outer_axis.seconds,
        fits=memory.total <= budget.memory_gb * GB)


def plan(model: ModelSpec, topology: Topology, budget: Budget) -> List[PlanRow]:
    """One row per flat level over ``N x M`` ranks, then (``M > 1``) one per valid pair on ``N x M``.

    Communication time is the sum of both axes' ring times with nothing overlapped:
    an upper bound on what a step exposes, good for ranking configurations.
    """
    rows = [_row(MeshStrategy(STRATEGIES[name], NO_SHARD), True, model, topology, budget) for name in STRATEGIES]
    if topology.domains > 1:
        rows += [_row(MeshStrategy(STRATEGIES[i], STRATEGIES[o]), False, model, topology, budget)
                 for i, o in valid_pairs()]
    return rows


def recommend(rows: Sequence[PlanRow], budget: Budget) -> Recommendation:
    """The fastest row that fits; among equally fast rows (within 1e-9), the one using least memory."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        best = min(rows, key=lambda r: r.memory.total)
        raise NothingFits(
            f"no configuration fits in {budget.memory_gb:g} GB per rank: the smallest, {best.name} on "
            f"{best.mesh} ranks, needs {best.memory.total / GB:.2f} GB. Add ranks (--gpus-per-domain, "
            "--domains), use fewer bytes per parameter, or shard the model (TP/PP) first.")
    fastest = min(r.comm_seconds for r in fitting)
    tied = [r for r in fitting if math.isclose(r.comm_seconds, fastest, rel_tol=1e-9)]
    best = min(tied, key=lambda r: r.memory.total)
    reason = (f"fastest of the {len(fitting)} of {len(rows)} configurations that fit in {budget.memory_gb:g} GB: "
              f"{best.comm_seconds * 1e3:.1f} ms of communication per step, {best.memory.total / GB:.2f} GB per rank")
    if len(tied) > 1:
        others = ", ".join(f"{r.name} ({r.mesh})" for r in tied if r is not best)
        reason += f"; as fast as {others}, with the least memory"
    return Recommendation(best, reason)


# ----------------------------------------------------------------------------- Megatron model size

@dataclasses.dataclass(frozen=True)
class GPTShape:
    """The Megatron arguments that decide a GPT's parameter count (TP = PP = EP = 1).

    Defaults are Megatron-Core's and ``pretrain_gpt.py``'s: LayerNorm with bias,
    linear biases, GeLU MLP, learned absolute positions, tied embedding and output.
    ``num_experts`` makes every layer's MLP a mixture of experts with a router.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    swiglu: bool = False
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: Optional[int] = None
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by``."""
    return -(-vocab_size // multiple) * multiple


def gpt_param_count(shape: GPTShape) -> int:
    """Parameters of Megatron-Core's ``GPTModel`` with the local layer spec, counted as it builds them."""
    h, heads = shape.hidden_size, shape.num_attention_heads
    groups = shape.num_query_groups or heads
    head_dim = shape.kv_channels or h // heads
    bias = 1 if shape.add_bias_linear else 0
    norm = (2 if shape.normalization == "LayerNorm" else 1) * h

    def mlp(ffn: int) -> int:
        fc1 = ffn * (2 if shape.swiglu else 1)
        return h * fc1 + bias * fc1 + ffn * h + bias * h

    qkv = (heads + 2 * groups) * head_dim
    attention = h * qkv + bias * qkv + heads * head_dim * h + bias * h
    if shape.num_experts:
        ffn = mlp(shape.moe_ffn_hidden_size or shape.ffn_hidden_size)
        feed_forward = shape.num_experts * ffn + shape.num_experts * h  # experts + router
    else:
        feed_forward = mlp(shape.ffn_hidden_size)
    layer = norm + attention + norm + feed_forward
    vocab = padded_vocab_size(shape.vocab_size, shape.make_vocab_size_divisible_by)
    positions = (shape.max_position_embeddings or shape.seq_length) if shape.position_embedding_type == "learned_absolute" else 0
    embedding = vocab * h + positions * h
    output = vocab * h if shape.untie_embeddings_and_output_weights else 0
    return embedding + shape.num_layers * layer + norm + output


# ----------------------------------------------------------------------------- printing

def _gb(x: float) -> str:
    return f"{x / GB:.2f}"


COLUMNS = ("config", "mesh", "params", "main", "grads", "optim", "total", "idle",
           "in AG", "in RS", "in AR", "out AG", "out RS", "out AR", "comm ms", "fits")


def format_table(rows: Sequence[PlanRow]) -> str:
    """Memory in GB per rank; traffic in GB sent per rank per step (ring); time in ms."""
    cells = [COLUMNS]
    for r in rows:
        mem = r.memory
        cells.append((r.name, r.mesh, _gb(mem.params), _gb(mem.main), _gb(mem.grads), _gb(mem.optim), _gb(mem.total),
                      _gb(mem.between_steps),
                      *(_gb(getattr(r.inner_axis.sent, k)) for k in KINDS),
                      *(_gb(getattr(r.outer_axis.sent, k)) for k in KINDS),
                      f"{r.comm_seconds * 1e3:.1f}", "yes" if r.fits else "no"))
    widths = [max(len(row[j]) for row in cells) for j in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def to_json(model: ModelSpec, topology: Topology, budget: Budget, rows: Sequence[PlanRow],
            choice: Optional[Recommendation], message: Optional[str]) -> str:
    def row(r: PlanRow) -> dict:
        out = dataclasses.asdict(r)
        out["memory"]["total"] = r.memory.total
        out["memory"]["between_steps"] = r.memory.between_steps
        return out

    return json.dumps({
        "model": dataclasses.asdict(model), "topology": dataclasses.asdict(topology),
        "budget": dataclasses.asdict(budget), "units": {"bytes": 1, "bandwidth": "GB/s", "time": "s"},
        "rows": [row(r) for r in rows],
        "recommendation": None if choice is None else {"name": choice.row.name, "mesh": choice.row.mesh,
                                                       "inner": choice.row.inner, "outer": choice.row.outer,
                                                       "reason": choice.reason},
        "message": message,
    }, indent=2)


# ----------------------------------------------------------------------------- command line

GPT_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
FFN_DEFAULT_FACTOR = 4  # --ffn-hidden-size defaults to 4 x --hidden-size, as in pretrain_gpt.py


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fsdp_planner.py", description=__doc__.split("\n\n")[0],
        epilog="Give the model size either as --params or as the Megatron GPT arguments. See docs/planner.md.")
    g = p.add_argument_group("model size (either --params or the Megatron arguments)")
    g.add_argument("--params", type=float, help="number of parameters, e.g. 7e9")
    for name in GPT_REQUIRED + ("num_experts", "moe_ffn_hidden_size", "num_query_groups", "kv_channels",
                                "max_position_embeddings"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--ffn-hidden-size", type=int, help=f"default: {FFN_DEFAULT_FACTOR} x --hidden-size (as pretrain_gpt.py)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g = p.add_argument_group("bytes per parameter (defaults: the design notes' 16)")
    g.add_argument("--param-bytes", type=float, default=2.0, help="compute weights (bf16: 2, fp32: 4)")
    g.add_argument("--main-bytes", type=float, default=4.0, help="fp32 main weights (0 for an fp32 model)")
    g.add_argument("--grad-bytes", type=float, default=2.0, help="gradient accumulator (this engine: 4)")
    g.add_argument("--optim-bytes", type=float, default=None,
                   help="optimizer state (default: Adam's two moments in --optim-state-dtype: 8 fp32, 4 bf16)")
    g.add_argument("--optim-state-dtype", choices=sorted(ADAM_STATE_BYTES), default="fp32",
                   help="dtype of Adam's moments (the engine's OptimizerPrecision / --exp-avg-dtype --exp-avg-sq-dtype)")
    g.add_argument("--reduce-bytes", type=float, default=None, help="gradients on the wire (default: --grad-bytes)")
    g = p.add_argument_group("topology and budget")
    g.add_argument("--gpus-per-domain", type=int, required=True, help="N: ranks per NVLink domain")
    g.add_argument("--domains", type=int, default=1, help="M: number of domains")
    g.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per rank inside a domain")
    g.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per rank across domains")
    g.add_argument("--memory-gb", type=float, required=True, help="persistent memory budget per rank (1e9 bytes)")
    g.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--param-gather", choices=sorted(QUANTIZED_GATHER_BYTES), default=None,
                   help="ZeRO-3's weight gathers as MixedPrecision(param_gather=QuantizedParamGather(recipe)) sends them "
                        "(FP8: 1 byte per element; MXFP8: plus one E8M0 scale per 32); every parameter counted as "
                        "a GEMM weight, so an upper bound on the saving (the engine gathers embeddings and norms "
                        "in the compute dtype)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def inputs_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Tuple[ModelSpec, Topology, Budget]:
    """Validate the arguments; every problem ends in ``parser.error`` (usage + message, exit 2)."""
    given = [name for name in GPT_REQUIRED + ("ffn_hidden_size",) if getattr(args, name) is not None]
    if args.params is not None and given:
        parser.error("give either --params or the Megatron arguments, not both")
    if args.params is None:
        if not given:
            parser.error("give the model size: --params 7e9, or --num-layers --hidden-size "
                         "--num-attention-heads --seq-length --vocab-size [--ffn-hidden-size]")
        missing = ["--" + n.replace("_", "-") for n in GPT_REQUIRED if getattr(args, n) is None]
        if missing:
            parser.error("the Megatron arguments also need " + " ".join(missing))
        if args.ffn_hidden_size is None:
            args.ffn_hidden_size = FFN_DEFAULT_FACTOR * args.hidden_size
        fields = {f.name for f in dataclasses.fields(GPTShape)}
        shape = GPTShape(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
        bad = [n for n in GPT_REQUIRED + ("ffn_hidden_size", "num_experts", "num_query_groups") if (getattr(shape, n) or 1) < 1]
        if bad:
            parser.error("must be positive: " + ", ".join("--" + n.replace("_", "-") for n in bad))
        if shape.kv_channels is None and shape.hidden_size % shape.num_attention_heads:
            parser.error(f"--hidden-size {shape.hidden_size} is not divisible by --num-attention-heads "
                         f"{shape.num_attention_heads}; pass --kv-channels")
        if shape.num_query_groups and shape.num_attention_heads % shape.num_query_groups:
            parser.error("--num-attention-heads must be a multiple of --num-query-groups")
        params = float(gpt_param_count(shape))
    else:
        params = args.params
        if not params > 0:
            parser.error(f"--params must be positive, got {params:g}")
    if args.optim_bytes is None:
        args.optim_bytes = ADAM_STATE_BYTES[args.optim_state_dtype]
    elif args.optim_state_dtype != "fp32":
        parser.error("give either --optim-bytes or --optim-state-dtype, not both")
    byte_args = ("param_bytes", "main_bytes", "grad_bytes", "optim_bytes", "reduce_bytes")
    negative = ["--" + n.replace("_", "-") for n in byte_args if (getattr(args, n) or 0) < 0]
    if negative:
        parser.error("bytes per parameter cannot be negative: " + ", ".join(negative))
    for name in ("gpus_per_domain", "domains", "micro_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("intra_bw", "inter_bw", "memory_gb"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name):g}")
    model = ModelSpec(params, StateBytes(args.param_bytes, args.main_bytes, args.grad_bytes, args.optim_bytes,
                                         args.reduce_bytes, QUANTIZED_GATHER_BYTES.get(args.param_gather)))
    return (model, Topology(args.gpus_per_domain, args.domains, args.intra_bw, args.inter_bw),
            Budget(args.memory_gb, args.micro_batches))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the table and the recommendation; exit 1 (with the reason) when nothing fits."""
    parser = build_parser()
    args = parser.parse_args(argv)
    model, topology, budget = inputs_from_args(parser, args)
    rows = plan(model, topology, budget)
    try:
        choice, message = recommend(rows, budget), None
    except NothingFits as exc:
        choice, message = None, str(exc)
    if args.json:
        print(to_json(model, topology, budget, rows, choice, message))
    else:
        b = model.bytes
        print(f"{model.params:.4g} parameters x {b.total:g} bytes (param {b.param:g} + main {b.main:g} + "
              f"grad {b.grad:g} + optim {b.optim:g}; grads reduced in {b.wire:g}); "
              f"{topology.gpus_per_domain} ranks per domain x {topology.domains} domains at "
              f"{topology.intra_bw:g} / {topology.inter_bw:g} GB/s; {budget.micro_batches} micro-batch(es) per step")
        print("memory: GB per rank at the optimizer step (idle: between steps, gradients released by zero_grad); "
              "traffic: GB sent per rank per step (in = inner or flat axis, out = outer axis)")
        if b.main > 0:
            print("ZeRO-3 rows keep no compute weights (each gather casts the main shard) except HFSDP-like pairs")
        print()
        print(format_table(rows))
        print()
        if choice is not None:
            r = choice.row
            levels = f"{r.inner} x {r.outer}" if r.outer else f"{r.inner}, flat"
            print(f"recommended: {r.name} on {r.mesh} ranks ({levels}): {choice.reason}")
    if message is not None:
        print("error: " + message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
