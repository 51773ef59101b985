"""tools/fsdp_planner.py: the design notes' worked example, the formulas against the engine's
own ledger and Megatron-Core's own model, the recommendation, and argument errors.

The pure model is tested in this process. Two cases run in the four-rank pool (the
smallest with a 2 x 2 mesh): one trains a small model under every level and pair and
returns the ledger, one builds Megatron-Core GPT models and counts their parameters.
"""

import contextlib
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


def _import_planner():
    # tools/ is not a package; registered in sys.modules so its dataclasses resolve their module.
    spec = importlib.util.spec_from_file_location("fsdp_planner", ROOT / "tools" / "fsdp_planner.py")
    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fp = sys.modules.get("fsdp_planner") or _import_planner()

WORKED = ["--params", "7e9", "--gpus-per-domain", "8", "--domains", "2"]
LEVELS = list(fp.STRATEGIES)


def rows_by_key(rows):
    return {(r.mesh, r.inner, r.outer): r for r in rows}


def worked_example(memory_gb=80.0, micro_batches=1, inter_bw=50.0):
    budget = fp.Budget(memory_gb, micro_batches)
    return fp.plan(fp.ModelSpec(7e9), fp.Topology(8, 2, 450.0, inter_bw), budget), budget


# ----------------------------------------------------------------------------- worked example

def test_worked_example_matches_the_design_notes():
    """7B, 16 bytes per parameter, N = 8, M = 2: the notes' 7 GB, 14 GB and 8.75 GB per rank, less the
    2 bytes of bf16 compute shard this engine's ZeRO-3 and HSDP do not keep (6.125 and 12.25 GB)."""
    rows = rows_by_key(worked_example()[0])
    psi = 7e9
    zero3 = rows[("16", "optim_grads_params", None)]
    hsdp = rows[("8x2", "optim_grads_params", "no_shard")]
    hfsdp = rows[("8x2", "optim_grads_params", "optim")]
    assert (zero3.name, hsdp.name, hfsdp.name) == ("ZeRO-3", "HSDP", "HFSDP")
    assert zero3.memory.params == hsdp.memory.params == 0.0  # each gather casts the main shard
    assert zero3.memory.total == pytest.approx(14 * psi / 16) == 6.125e9
    assert hsdp.memory.total == pytest.approx(14 * psi / 8) == 12.25e9
    # The notes' split: bf16 params and grads (4Ψ) over the domain, 12Ψ of optimizer state over all 16.
    assert hfsdp.memory.params + hfsdp.memory.grads == pytest.approx(4 * psi / 8) == 3.5e9
    assert hfsdp.memory.main + hfsdp.memory.optim == pytest.approx(12 * psi / 16) == 5.25e9
    assert hfsdp.memory.total == pytest.approx(8.75e9)


def test_worked_example_table_prints_the_three_values(capsys):
    assert fp.main(WORKED + ["--memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    totals = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in ("ZeRO-3", "HSDP", "HFSDP") and cells[1] in ("16", "8x2"):
            totals[cells[0]] = cells[6]  # config, mesh, params, main, grads, optim, total
    assert totals == {"ZeRO-3": "6.12", "HSDP": "12.25", "HFSDP": "8.75"}
    assert "recommended: " in out


def test_script_runs_from_the_command_line_as_json():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "fsdp_planner.py"), *WORKED, "--memory-gb", "10",
                           "--micro-batches", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["rows"]) == 4 + 10
    assert out["recommendation"]["name"] == "HFSDP" and out["message"] is None
    hfsdp = next(r for r in out["rows"] if r["name"] == "HFSDP")
    assert hfsdp["memory"]["total"] == pytest.approx(8.75e9)


# ----------------------------------------------------------------------------- memory

BYTES = {
    "notes": fp.StateBytes(),
    "engine_fp32": fp.StateBytes(param=4, main=0, grad=4, optim=8),
    "engine_bf16": fp.StateBytes(param=2, main=4, grad=4, optim=8),
}


@pytest.mark.parametrize("bytes_", BYTES.values(), ids=BYTES.keys())
@pytest.mark.parametrize("n, m", [(8, 2), (4, 1), (3, 5)])
def test_memory_decreases_monotonically_with_level(n, m, bytes_):
    rows = fp.plan(fp.ModelSpec(1e9, bytes_), fp.Topology(n, m), fp.Budget(80.0))
    flat = [r.memory.total for r in rows if r.outer is None]
    assert [r.inner for r in rows if r.outer is None] == LEVELS
    assert all(a > b for a, b in zip(flat, flat[1:])), flat
    pairs = rows_by_key(rows)
    for inner in LEVELS:  # on N x M, a finer outer level never costs memory
        column = [pairs[(f"{n}x{m}", inner, outer)].memory.total for outer in LEVELS
                  if (f"{n}x{m}", inner, outer) in pairs]
        assert all(a >= b for a, b in zip(column, column[1:])), (inner, column)


def test_single_domain_has_flat_rows_only():
    rows = fp.plan(fp.ModelSpec(1e9), fp.Topology(8, 1), fp.Budget(80.0))
    assert [(r.mesh, r.outer) for r in rows] == [("8", None)] * 4
    assert all(r.outer_axis.sent.total == 0 for r in rows)


# ----------------------------------------------------------------------------- traffic

def test_ring_costs_and_bandwidths():
    rows = rows_by_key(worked_example()[0])
    hsdp = rows[("8x2", "optim_grads_params", "no_shard")]
    # Outer all-reduce of the 1/N inner shard of bf16 gradients, 2(M-1)/M of it sent, at 50 GB/s.
    assert hsdp.outer_axis.ledger.all_reduce == pytest.approx(2 * 7e9 / 8)
    assert hsdp.outer_axis.sent.all_reduce == pytest.approx(2 * 0.5 * 2 * 7e9 / 8)
    assert hsdp.outer_axis.seconds == pytest.approx(1.75e9 / 50e9)
    # ZeRO-3 gathers twice per micro-batch inside the domain: (N-1)/N of 2 x 14 GB at 450 GB/s.
    assert hsdp.inner_axis.sent.all_gather == pytest.approx(7 / 8 * 2 * 14e9)
    flat = rows[("16", "optim_grads_params", None)]
    assert flat.inner_axis.bandwidth == 400.0  # min(8/7 x 450, 8 NICs x 50)
    assert fp.Topology(8, 1).flat_bandwidth() == 450.0 and fp.Topology(1, 4).flat_bandwidth() == 50.0


def engine_ledger(ctx, micro_batches: int, hidden: int = 64, units: int = 3):
    """Pool case: one bf16 AdamW step under every flat level (4 ranks) and every pair (2 x 2).

    Every parameter sits in a unit (the root holds none) so the planner's assumption
    holds; returns ``{label: {"kind/axis": bytes}}`` without the grad-norm scalar.
    """
    import torch

    import megatron.fsdp as mfsdp
    from megatron.fsdp.sharding.strategy import valid_pairs

    configs = [(level, None) for level in LEVELS] + list(valid_pairs())
    out = {"params": units * (hidden * hidden + hidden)}
    for inner, outer in configs:
        torch.manual_seed(0)
        module = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(units)])
        where = dict(mesh=ctx.group) if outer is None else dict(mesh=ctx.meshes[(2, 2)], outer_strategy=outer)
        model = mfsdp.fully_shard(module, strategy=inner, unit_modules=(torch.nn.Linear,),
                                  mixed_precision=mfsdp.MixedPrecision(param_dtype=torch.bfloat16), **where)
        opt = mfsdp.FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        model.ledger.trace = True
        model.ledger.reset()
        for k in range(micro_batches):
            with model.no_sync() if k < micro_batches - 1 else contextlib.nullcontext():
                model(torch.randn(4, hidden)).float().pow(2).mean().backward()
        opt.step()
        # Land the post-step gathers: a chained stage (inner after outer) is issued only then.
        model.wait_weights()
        counted = {f"memory/{k}": v for k, v in dataclasses.asdict(model.memory_report(opt)).items()}
        for e in model.ledger.events:
            if e.tag != "grad_norm":
                counted[f"{e.kind}/{e.axis}"] = counted.get(f"{e.kind}/{e.axis}", 0) + e.nbytes
        out[f"{inner}/{outer}"] = counted
    return out


def test_traffic_formulas_match_the_engine_ledger(mcore_pool):
    micro_batches, units = 2, 3
    measured = mcore_pool.run(engine_ledger, size=4, micro_batches=micro_batches, units=units)[0]
    # The planner gathers every unit before its forward and its backward; the engine keeps the unit the
    # backward starts with gathered from its forward, once a pass has shown the order (from the second
    # micro-batch of this first step on): that many of the 2 x micro_batches x units gathers are not sent.
    held = (micro_batches - 1) / (2 * micro_batches * units)
    model = fp.ModelSpec(measured["params"], fp.StateBytes(param=2, main=4, grad=4, optim=8, reduce=4))
    rows = fp.plan(model, fp.Topology(2, 2), fp.Budget(1.0, micro_batches))
    assert len(rows) == len(measured) - 1
    for row in rows:
        got = measured[f"{row.inner}/{row.outer}"]
        for axis, traffic in (("dp_shard", row.inner_axis), ("dp_outer", row.outer_axis)):
            for kind in fp.KINDS:
                expected, actual = getattr(traffic.ledger, kind), got.get(f"{kind}/{axis}", 0)
                level = row.inner if axis == "dp_shard" else row.outer
                if kind == "all_gather" and level is not None and fp.STRATEGIES[level].shard_params:
                    expected *= 1 - held
                if expected == 0:
                    assert actual == 0, (row.name, row.mesh, kind, axis, got)
                else:  # the engine pads each buffer to the alignment and the rank count
                    assert 0 <= actual / expected - 1 < 0.01, (row.name, row.mesh, kind, axis, actual, expected)
        kinds = {"compute_weights": "params", "main_weights": "main", "main_grads": "grads", "optimizer_state": "optim"}
        for kind, field in kinds.items():  # persistent bytes: no compute copy under ZeRO-3 but HFSDP's
            expected, actual = getattr(row.memory, field), got[f"memory/{kind}"]
            assert (actual == 0) if expected == 0 else abs(actual / expected - 1) < 0.01, (row.name, kind, actual)


# ----------------------------------------------------------------------------- Megatron model size

GPT_SHAPES = [
    dict(),
    dict(untie_embeddings_and_output_weights=True, max_position_embeddings=48),
    dict(num_query_groups=2),
    dict(swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope"),
    dict(num_experts=4, add_bias_linear=False),
    dict(num_experts=4, moe_ffn_hidden_size=48, add_bias_linear=False, swiglu=True),
]
GPT_BASE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, seq_length=32, vocab_size=1000)


def megatron_param_counts(ctx, shapes):
    """Pool case: build each shape as Megatron-Core's ``GPTModel`` (local spec) and count its parameters."""
    import torch.nn.functional as F

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.fsdp_training.testing.gpt import Topology, parallel

    counts = []
    with parallel(ctx, Topology()):
        for extra in shapes:
            s = fp.GPTShape(**GPT_BASE, **extra)
            config = dict(num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
                          num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
                          add_bias_linear=s.add_bias_linear, normalization=s.normalization,
                          use_cpu_initialization=True)
            if s.swiglu:
                config.update(gated_linear_unit=True, activation_func=F.silu)
            if s.num_experts:
                config.update(num_moe_experts=s.num_experts, moe_router_topk=2,
                              moe_ffn_hidden_size=s.moe_ffn_hidden_size or s.ffn_hidden_size)
            spec = get_gpt_layer_local_spec(num_experts=s.num_experts, moe_grouped_gemm=False,
                                            normalization=s.normalization)
            model = GPTModel(config=TransformerConfig(**config), transformer_layer_spec=spec,
                             vocab_size=fp.padded_vocab_size(s.vocab_size, s.make_vocab_size_divisible_by),
                             max_sequence_length=s.max_position_embeddings or s.seq_length,
                             share_embeddings_and_output_weights=not s.untie_embeddings_and_output_weights,
                             position_embedding_type=s.position_embedding_type)
            counts.append(sum(p.numel() for p in model.parameters()))
    return counts


def test_param_count_matches_megatron_core(mcore_pool):
    counts = mcore_pool.run(megatron_param_counts, shapes=GPT_SHAPES)[0]
    expected = [fp.gpt_param_count(fp.GPTShape(**GPT_BASE, **extra)) for extra in GPT_SHAPES]
    assert counts == expected


def test_megatron_arguments_give_the_model_size(capsys):
    args = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008", "--num-attention-heads", "32",
            "--seq-length", "4096", "--vocab-size", "32000", "--swiglu", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
            "--gpus-per-domain", "8", "--domains", "2", "--memory-gb", "80", "--json"]
    assert fp.main(args) == 0
    # Llama-2 7B: 6,738,415,616 parameters.
    assert json.loads(capsys.readouterr().out)["model"]["params"] == 6738415616


# ----------------------------------------------------------------------------- recommendation

def test_bf16_optimizer_state_halves_the_optimizer_column(capsys):
    assert fp.main(WORKED + ["--memory-gb", "80", "--optim-state-dtype", "bf16", "--json"]) == 0
    rows = {(r["name"], r["mesh"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[("ZeRO-3", "16")]["memory"]["optim"] == pytest.approx(4 * 7e9 / 16)
    assert rows[("ZeRO-3", "16")]["memory"]["total"] == pytest.approx(10 * 7e9 / 16)
    with pytest.raises(SystemExit):
        fp.main(WORKED + ["--memory-gb", "80", "--optim-state-dtype", "bf16", "--optim-bytes", "4"])
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("recipe, ratio", [("tensorwise", 0.5), ("delayed", 0.5), ("mxfp8", 33 / 64)])
def test_quantized_param_gather_scales_only_zero3_gathers(recipe, ratio, capsys):
    """--param-gather: ZeRO-3's weight gathers at 1 byte per element (MXFP8: + 1/32 for the E8M0 scales),
    0.50x / 0.516x of bf16's; reduce-scatters, the optim level's main-weight installs and memory unchanged."""
    def rows(*extra):
        assert fp.main(WORKED + ["--memory-gb", "80", "--json", *extra]) == 0
        return {(r["name"], r["mesh"]): r for r in json.loads(capsys.readouterr().out)["rows"]}

    bf16, fp8 = rows(), rows("--param-gather", recipe)
    zero3, base = fp8[("ZeRO-3", "16")]["inner_axis"], bf16[("ZeRO-3", "16")]["inner_axis"]
    assert zero3["ledger"]["all_gather"] == pytest.approx(ratio * base["ledger"]["all_gather"]) and ratio < 1
    assert zero3["ledger"]["reduce_scatter"] == base["ledger"]["reduce_scatter"]
    assert fp8[("ZeRO-1", "16")] == bf16[("ZeRO-1", "16")]
    assert all(fp8[k]["memory"] == bf16[k]["memory"] for k in bf16)
    with pytest.raises(SystemExit):
        fp.main(WORKED + ["--memory-gb", "80", "--param-gather", "blockwise"])
    assert "invalid choice: 'blockwise'" in capsys.readouterr().err


def test_recommendation_under_a_tight_budget():
    """10 GB leaves ZeRO-3 (flat and 8x2), HFSDP and ZeRO-3 x ZeRO-2; micro-batches decide."""
    rows, budget = worked_example(memory_gb=10.0, micro_batches=8)
    assert sorted(r.name for r in rows if r.fits) == sorted(["ZeRO-3", "HFSDP", "ZeRO-3 x ZeRO-2", "ZeRO-3 x ZeRO-3"])
    choice = fp.recommend(rows, budget)
    # Eight micro-batches: gathering across domains every micro-batch costs more than
    # HFSDP's once-per-step outer reduce-scatter and all-gather.
    assert (choice.row.name, choice.row.mesh) == ("HFSDP", "8x2")
    assert "fit in 10 GB" in choice.reason
    rows, budget = worked_example(memory_gb=10.0, micro_batches=1)
    assert fp.recommend(rows, budget).row.name == "ZeRO-3"  # one micro-batch: the flat ring is faster


def test_ties_go_to_the_least_memory():
    # A slow network: HFSDP and ZeRO-3 x ZeRO-2 move the same bytes across domains once per step.
    rows, budget = worked_example(memory_gb=10.0, micro_batches=1, inter_bw=5.0)
    choice = fp.recommend(rows, budget)
    hfsdp = rows_by_key(rows)[("8x2", "optim_grads_params", "optim")]
    assert choice.row.name == "ZeRO-3 x ZeRO-2"
    assert choice.row.comm_seconds == pytest.approx(hfsdp.comm_seconds)
    assert choice.row.memory.total < hfsdp.memory.total
    assert "as fast as HFSDP (8x2), with the least memory" in choice.reason


# ----------------------------------------------------------------------------- errors

def test_budget_that_nothing_fits_is_a_clear_message(capsys):
    assert fp.main(WORKED + ["--memory-gb", "5"]) == 1
    captured = capsys.readouterr()
    assert "error: no configuration fits in 5 GB per rank" in captured.err
    assert "ZeRO-3 on 16 ranks, needs 6.12 GB" in captured.err
    assert "Traceback" not in captured.err and "recommended" not in captured.out
    assert fp.main(WORKED + ["--memory-gb", "5", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["recommendation"] is None and out["message"].startswith("no configuration fits")


@pytest.mark.parametrize("argv, message", [
    (["--gpus-per-domain", "8", "--memory-gb", "80"], "give the model size"),
    (WORKED + ["--num-layers", "2", "--memory-gb", "80"], "not both"),
    (["--num-layers", "2", "--hidden-size", "64", "--gpus-per-domain", "8", "--memory-gb", "80"],
     "also need --num-attention-heads --seq-length --vocab-size"),
    (["--num-layers", "2", "--hidden-size", "65", "--ffn-hidden-size", "4", "--num-attention-heads", "4",
      "--seq-length", "8", "--vocab-size", "8", "--gpus-per-domain", "8", "--memory-gb", "80"], "not divisible"),
    (WORKED + ["--memory-gb", "0"], "--memory-gb must be positive"),
    (["--params", "7e9", "--gpus-per-domain", "8", "--domains", "0", "--memory-gb", "80"], "--domains must be at least 1"),
    (WORKED + ["--memory-gb", "80", "--grad-bytes", "-2"], "cannot be negative: --grad-bytes"),
    (WORKED + ["--memory-gb", "80", "--micro-batches", "0"], "--micro-batches must be at least 1"),
    (["--params", "7e9", "--domains", "2", "--memory-gb", "80"], "--gpus-per-domain"),
])
def test_argument_errors_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        fp.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_ffn_hidden_size_defaults_to_4_x_hidden_like_the_job():
    parser = fp.build_parser()
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--vocab-size", "1000", "--gpus-per-domain", "8", "--memory-gb", "80"]
    implicit = fp.inputs_from_args(parser, parser.parse_args(model))[0]
    explicit = fp.inputs_from_args(parser, parser.parse_args(model + ["--ffn-hidden-size", "256"]))[0]
    assert implicit == explicit
