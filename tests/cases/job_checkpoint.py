"""Worker side of the checkpoint tests: the training job's pieces inside a gloo pool (no new processes)."""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron.fsdp_training.testing.megatron_case import megatron_case


def _snapshot(model, optimizer) -> Dict[str, torch.Tensor]:
    """Full weights and this rank's optimizer state (copies), to show a failed load changed nothing."""
    out = {f"model.{k}": v for chunk in model for k, v in chunk.full_state_dict().items()}
    for k, v in optimizer.state_dict().items():
        local = v._local_tensor if hasattr(v, "_local_tensor") else v
        out[f"optimizer.{k}"] = local.clone() if isinstance(local, torch.Tensor) else local
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def load_error(ctx, argv: List[str]) -> Dict[str, object]:
    """Build the model of ``argv``, try ``--load``: the error, and whether anything changed."""
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        before = _snapshot(model, optimizer)
        lr = optimizer.param_groups[0]["lr"]
        try:
            checkpointing.load_checkpoint(args, model, optimizer, scheduler)
            error = None
        except checkpointing.CheckpointError as exc:
            error = str(exc)
        after = _snapshot(model, optimizer)
        unchanged = sorted(before) == sorted(after) and all(_same(before[k], after[k]) for k in before)
        return {"error": error, "unchanged": unchanged and optimizer.param_groups[0]["lr"] == lr}


def _causal_inputs(vocab: int, seq: int):
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (2, seq), generator=gen)
    positions = torch.arange(seq).unsqueeze(0).expand(2, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    return tokens, positions, mask


def _compute_matches_main(chunk) -> bool:
    """Compute weights equal the main weights cast to the compute dtype wherever this rank holds both."""
    ok = True
    for unit in chunk.fsdp.units:
        s = unit.storage
        a, b = s.regions.main
        if a < b:
            ok &= torch.equal(s.compute_slice(a, b), s.main.to(s.compute_dtype))
    return bool(ok)


@torch.no_grad()
def loaded_vs_unsharded(ctx, argv: List[str], model_file: str) -> Dict[str, object]:
    """Logits of the sharded model after ``--load`` against an unsharded GPTModel loaded from ``model_file``.

    Also: compute weights equal the loaded main weights before the first forward,
    and the unsharded model's weights equal the sharded model's full weights.
    """
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training import model as model_lib
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    with megatron_case():
        device, _, model, optimizer, scheduler = setup(args)
        iteration, _ = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
        compute_ok = all(_compute_matches_main(chunk) for chunk in model)
        tokens, positions, mask = _causal_inputs(args.padded_vocab_size, args.seq_length)
        model[0].eval()
        sharded = model[0](tokens, positions, mask)
        full = model[0].full_state_dict()
        config = model_lib.transformer_config(args, device.type == "cpu")
        plain = model_lib.build_model_chunks(args, config, args.padded_vocab_size, device.type == "cpu")[0]
        result = plain.load_state_dict(torch.load(model_file, weights_only=False), strict=False)
        plain.eval()
        unsharded = plain(tokens, positions, mask)
        plain_sd = plain.state_dict()
        return {"iteration": iteration, "compute_matches_main": compute_ok,
                "missing": [k for k in result.missing_keys if not k.endswith("_extra_state")],
                "unexpected": list(result.unexpected_keys),
                "weights_equal": all(torch.equal(plain_sd[k], v) for k, v in full.items()),
                "max_logit_diff": float((sharded - unsharded).abs().max())}


def rng_round_trip(ctx, argv: List[str], directory: str) -> Dict[str, bool]:
    """Draws after a load equal the draws after the save, for every generator a checkpoint restores."""
    import random

    import numpy as np

    from megatron.core import tensor_parallel
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    def draws():
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tracked = torch.rand(2)
        return {"torch": torch.rand(3), "python": random.random(), "numpy": float(np.random.rand()),
                "tracker": tracked}

    args = parse_args(argv + ["--save", directory, "--load", directory])
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        draws()  # move every generator away from its seed
        checkpointing.save_checkpoint(args, 1, args.global_batch_size, model, optimizer, scheduler)
        expected = draws()
        draws()
        iteration, consumed = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
        got = draws()
        same = {k: bool(torch.equal(v, got[k])) if isinstance(v, torch.Tensor) else v == got[k]
                for k, v in expected.items()}
        return {**same, "position": (iteration, consumed) == (1, args.global_batch_size)}


def failing_background_write(ctx, argv: List[str], rank: int, iteration: int) -> Dict[str, object]:
    """``pretrain`` with --async-save whose background write of ``iteration`` fails on ``rank``.

    The failure is the one an unwritable directory gives (the writer's open() raises
    PermissionError): as root, permissions do not stop a write, so the test
    injects it at the write step itself. Returns the error each rank stopped with.
    """
    import torch.distributed as dist

    from megatron.fsdp_training.checkpointing import save_steps
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.checkpointing.files import CheckpointError
    from megatron.fsdp_training.training import pretrain

    real = save_steps.write_pieces

    def write(staged):
        if staged.iteration == iteration and dist.get_rank() == rank:
            raise PermissionError(13, "Permission denied", str(staged.tmp / f"__{rank}_0.distcp"))
        return real(staged)

    save_steps.write_pieces = write
    try:
        with megatron_case():
            pretrain(parse_args(argv))
        return {"error": None}
    except CheckpointError as exc:
        return {"error": str(exc)}
    finally:
        save_steps.write_pieces = real


def fresh_then_loaded(ctx, argv: List[str], fresh, loaded: str) -> None:
    """Save the freshly built model of ``argv`` (iteration 0) to ``fresh`` (unless None), load ``--load``,
    save it to ``loaded``."""
    from megatron.fsdp_training.checkpointing import save_load as checkpointing
    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    with megatron_case():
        _, _, model, optimizer, scheduler = setup(args)
        for directory in [d for d in (fresh, loaded) if d]:
            args.save = directory
            if directory == loaded:
                iteration, consumed = checkpointing.load_checkpoint(args, model, optimizer, scheduler)
            else:
                iteration, consumed = 0, 0
            checkpointing.save_checkpoint(args, iteration, consumed, model, optimizer, scheduler)


def layout_v1_translation(ctx, directory: str) -> Dict[str, bool]:
    """A layout-1 checkpoint made here (EP 2 x expert TP 2 grouped-GEMM weights in their raw shapes, a TP-split
    and a replicated weight, each key's raw tensor split over the 2 ranks mid-row as the engine's flat pieces)
    read through ``checkpoint_v1.TranslatedReader`` into full TP-global tensors: each shard where it belongs."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron.fsdp.checkpoint.pieces import sharded_piece
    from megatron.fsdp_training.checkpointing.layout_v1 import Rule, TranslatedReader

    rank, gen = dist.get_rank(), torch.Generator().manual_seed(5)
    experts, hidden, ffn, local_experts, local_ffn = 4, 3, 4, 2, 2
    w1, w2 = "decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"
    proj, norm = "decoder.layers.0.self_attention.linear_proj.weight", "decoder.final_layernorm.weight"
    raw = {}  # v1 key: the whole raw tensor of that TP (and EP) rank
    for t in range(2):
        for e in range(2):
            raw[f"tp{t}.ep{e}.{w1}"] = torch.randn(hidden, local_experts * 2 * local_ffn, generator=gen)  # GLU
            raw[f"tp{t}.ep{e}.{w2}"] = torch.randn(local_experts * local_ffn, hidden, generator=gen)
        raw[f"tp{t}.{proj}"] = torch.randn(hidden, 2, generator=gen)
        raw[f"tp{t}.{norm}"] = torch.full((hidden,), 1.0 + t)  # replicated: TP rank 0's copy is read
    pieces = {}
    for key, value in raw.items():
        cut = value.numel() // 2 + 1  # inside a row
        lo, hi = (0, cut) if rank == 0 else (cut, value.numel())
        pieces[key] = sharded_piece(value.reshape(-1)[lo:hi].clone(), value.shape, lo)
    dcp.save({"model": pieces}, checkpoint_id=directory)
    rules = {w1: Rule("grouped", 3, (experts, hidden, 2, ffn)), w2: Rule("grouped", 1, (experts, ffn, hidden)),
             proj: Rule("split", 1)}
    state = {"model": {w1: torch.zeros(experts, hidden, 2, ffn), w2: torch.zeros(experts, ffn, hidden),
                       proj: torch.zeros(hidden, 4), norm: torch.zeros(hidden)}}
    dcp.load(state, storage_reader=TranslatedReader(directory, rules))
    got, ok = state["model"], {}
    for t in range(2):
        f = slice(t * local_ffn, (t + 1) * local_ffn)
        for e in range(2):
            x = slice(e * local_experts, (e + 1) * local_experts)
            ok[f"w1 tp{t} ep{e}"] = torch.equal(got[w1][x, :, :, f],
                                                raw[f"tp{t}.ep{e}.{w1}"].view(local_experts, hidden, 2, local_ffn))
            ok[f"w2 tp{t} ep{e}"] = torch.equal(got[w2][x, f], raw[f"tp{t}.ep{e}.{w2}"].view(local_experts,
                                                                                            local_ffn, hidden))
        ok[f"proj tp{t}"] = torch.equal(got[proj][:, 2 * t:2 * t + 2], raw[f"tp{t}.{proj}"])
    ok["norm"] = torch.equal(got[norm], raw[f"tp0.{norm}"])
    return ok


def _adam_state(optimizer) -> Dict[str, torch.Tensor]:
    """Every optimizer state tensor of this rank (moments, step, initialised flag), as local copies."""
    out = {}
    for k, v in optimizer.state_dict().items():
        local = v._local_tensor if hasattr(v, "_local_tensor") else v
        if isinstance(local, torch.Tensor):
            out[k] = local.clone()
    return out


def trainer_preload_copy(ctx, argv: List[str], directory: str) -> Dict[str, object]:
    """Megatron-LM's and Bridge's ``fsdp_dtensor`` round trip: save ``optimizer.sharded_state_dict``; at load, keep
    a shallow copy of the optimizer and model dicts from before ``dcp.load`` and hand those copies to
    ``load_state_dict`` (only what ``dcp.load`` filled in place survives). Returns the keys whose loaded state
    differs from the saved one (every Adam moment, the step, the flag) and whether any were compared."""
    import torch.distributed.checkpoint as dcp

    from megatron.fsdp_training.arguments import parse_args
    from megatron.fsdp_training.job_setup import setup

    args = parse_args(argv)
    metadata = {"distrib_optim_sharding_type": "fsdp_dtensor"}
    with megatron_case():
        _, _, model, optimizer, _ = setup(args)
        tokens, positions, mask = _causal_inputs(args.padded_vocab_size, args.seq_length)
        for _ in range(2):
            model[0](tokens, positions, mask, labels=tokens).float().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        saved = _adam_state(optimizer)
        dcp.save({"model": model[0].state_dict_for_save_checkpoint(),
                  "optimizer": optimizer.sharded_state_dict({}, metadata=metadata)}, checkpoint_id=directory)
    with megatron_case():
        _, _, model, optimizer, _ = setup(args)  # fresh: no Adam state yet, as a trainer's load finds it
        state = {"model": model[0].state_dict_for_save_checkpoint(),
                 "optimizer": optimizer.sharded_state_dict({}, is_loading=True, metadata=metadata)}
        raw_model, raw_optimizer = state["model"].copy(), state["optimizer"].copy()
        dcp.load(state, checkpoint_id=directory)
        model[0].load_state_dict(raw_model)
        optimizer.load_state_dict(raw_optimizer)
        loaded = _adam_state(optimizer)
        differ = sorted(k for k in saved if k not in loaded or not _same(saved[k], loaded[k]))
        return {"differ": differ, "compared": sorted(saved), "initialized": bool(loaded.get("state_initialized"))}
