"""Non-persistent checkpoints (Megatron-LM's ``--non-persistent-save-interval``, ``--non-persistent-ckpt-type``).

Why: a persistent checkpoint every few hundred iterations is what a run keeps; between them a crash loses
the work since the last one. Non-persistent checkpoints are written more often and only the newest is
kept. Megatron-LM's meanings (``megatron/training/checkpointing.py``, ``training.py``), kept here:

- a non-persistent save runs every ``--non-persistent-save-interval`` iterations, only with ``--save``, and
  not at an iteration where the persistent save runs (that one wins);
- ``global``: a complete ``fsdp_dtensor`` checkpoint (the same save, manifest, atomic publish and tracker as
  ``--save``'s) into ``--non-persistent-global-ckpt-dir``, default ``<--save>/non_persistent`` (loading:
  ``<--load>/non_persistent``). Megatron-LM removes the older ones before it writes the new one; here they are
  removed only once the new one is published, so a crash mid-save never leaves nothing;
- ``local``: every rank writes its own pieces to ``--non-persistent-local-ckpt-dir``/``rank_<r>`` (node-local
  storage) with a completeness marker; no rank ever reads another rank's files or a shared metadata file. A
  save is kept only if every rank completed it (the ranks agree, then drop their older one);
- the load (``load_checkpoint``): the newer of ``--load``'s checkpoint and the non-persistent one (the
  non-persistent one at equal iterations, as Megatron-LM), said in one line with the reason. A local
  checkpoint is used only if every rank holds the same newest complete iteration, its files verify and it
  was written with this job's layout (world size, TP/PP/CP/EP, levels); otherwise one line says why not and
  which checkpoint is loaded instead. ``--ckpt-step`` names a persistent checkpoint: that one is loaded.

Non-persistent saves never write into ``--save``'s ``iter_*`` directories, so they never overwrite a
persistent checkpoint; a non-persistent one that is newer than the run's start is replaced by its first
non-persistent save, said at start-up (``check_newer``). The flags and their start-up rules are in
``arguments/non_persistent.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import files, manifest, ownership, paths, save_load, save_steps
from .files import CheckpointError
from ..logs.lines import print_rank_0

MARKER = "local_complete.json"  # a local checkpoint's completeness marker (written last, before the rename)
PIECES = "pieces.pt"  # this rank's pieces of a local checkpoint
_held: List[Path] = []  # the directories whose lock this process holds (``hold``)


def kind(args) -> Optional[str]:
    return getattr(args, "non_persistent_ckpt_type", None)


def due(args, iteration: int) -> bool:
    """A non-persistent save at ``iteration`` (the loop asks only when no persistent save runs there)."""
    interval = getattr(args, "non_persistent_save_interval", None)
    return bool(args.save and interval and iteration % interval == 0)


def global_dir(args, base: Optional[str]) -> Optional[Path]:
    """``--non-persistent-global-ckpt-dir``, else ``base/non_persistent`` (``base``: --save or --load)."""
    if args.non_persistent_global_ckpt_dir:
        return Path(args.non_persistent_global_ckpt_dir)
    return None if base is None else Path(base) / paths.NON_PERSISTENT_SUBDIR


def local_dir(args, rank: int) -> Path:
    return Path(args.non_persistent_local_ckpt_dir) / f"rank_{rank:05d}"


def _all_lines(mine: Optional[str]) -> List[Tuple[int, str]]:
    """Every rank's line (a collective): ``(rank, line)`` of the ranks that have one, the same on every rank."""
    gathered: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [(r, line) for r, line in enumerate(gathered) if line]


# ------------------------------------------------------------------ the locks
def _write_targets(args) -> List[Tuple[str, Path]]:
    """The directories this rank writes non-persistent checkpoints to, with their flag (none when not saving).
    The default global directory lies inside ``--save``, whose lock covers it."""
    if not getattr(args, "non_persistent_save_interval", None):
        return []
    if kind(args) == "local":
        return [("--non-persistent-local-ckpt-dir", local_dir(args, dist.get_rank()))]
    if dist.get_rank() == 0 and args.non_persistent_global_ckpt_dir:
        return [("--non-persistent-global-ckpt-dir", global_dir(args, args.save))]
    return []


def hold(args) -> None:
    """At start-up (all ranks, a collective): lock the non-persistent directories this job writes, as ``--save``'s
    (``ownership.acquire_save_lock``); a directory that cannot be written or that another live job holds stops
    every rank with the same line."""
    problem = None
    notes = []
    for flag, directory in _write_targets(args):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            removed = paths.remove_stale_temporaries(directory)
            if removed:
                notes.append(f" removed {len(removed)} unfinished save(s) of a dead job from {directory}")
            problem, note = ownership.acquire_save_lock(directory)
            if note:
                notes.append(note)
            if problem:
                problem = problem.replace("--save", flag, 1)
            else:
                _held.append(directory)
        except OSError as exc:
            problem = f"{flag} {directory} is not writable ({exc.strerror or exc}); choose a writable directory"
    if notes:
        print("\n".join(notes), flush=True)
    failed = _all_lines(problem)
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")


def release(args) -> None:
    """At the end of the job (this process; no collective)."""
    while _held:
        ownership.release_save_lock(_held.pop())


# ------------------------------------------------------------------ save
def save(args, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
    """The non-persistent save of ``iteration`` (all ranks)."""
    if kind(args) == "global":
        _save_global(args, iteration, consumed, model, optimizer, scheduler)
    else:
        _save_local(args, iteration, consumed, model, optimizer, scheduler)


def _save_global(args, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
    root = global_dir(args, args.save)
    saving_args = argparse.Namespace(**dict(vars(args), save=str(root)))
    final = save_load.save_checkpoint(saving_args, iteration, consumed, model, optimizer, scheduler)
    if dist.get_rank() == 0:  # published (save_checkpoint returns on every rank once it is visible)
        removed = _remove_others(root, final.name)
        if removed:
            print_rank_0(f" non-persistent checkpoints: kept {final.name} in {root}, removed {', '.join(removed)}")


def _remove_others(root: Path, keep: str) -> List[str]:
    """Every ``iter_*`` (and set-aside copy) of ``root`` but ``keep``: only the newest is kept."""
    removed = []
    for entry in sorted(Path(root).iterdir()):
        if entry.is_dir() and entry.name != keep and entry.name.startswith(("iter_", ".old_iter_")):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _local_pieces(state: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's pieces, flat: a DTensor as its local tensor (the layout is checked by the marker)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(state)
    return {k: (v._local_tensor if isinstance(v, DTensor) else v) for k, v in flat.items()}


def _marker(args, iteration: int) -> Dict[str, Any]:
    return {"iteration": iteration, "rank": dist.get_rank(), "parallel_layout": save_load.parallel_layout(args)}


def _write_local(args, root: Path, iteration: int, consumed: int, model, optimizer, scheduler) -> Path:
    """This rank alone: its pieces, ``common.json``, the marker and a manifest in a temporary, renamed into place."""
    root.mkdir(parents=True, exist_ok=True)
    paths.remove_stale_temporaries(root)
    state = save_steps.host_copies(save_load.save_state_dict(model, optimizer))
    tmp = files.temporary_dir(root, iteration, files.new_nonce())
    ownership.write_owner(tmp)
    with open(tmp / PIECES, "wb") as f:
        torch.save(_local_pieces(state), f)
        f.flush()
        os.fsync(f.fileno())
    files.write_common(tmp, save_load.common_record(args, iteration, consumed, scheduler))
    files.write_file_durably(tmp / MARKER, json.dumps(_marker(args, iteration), sort_keys=True))
    manifest.write_manifest(tmp, {}, extra=[PIECES, files.COMMON, MARKER])
    (tmp / ownership.OWNER).unlink(missing_ok=True)
    files.fsync_dir(tmp)
    final = root / files.iteration_dir_name(iteration)
    if final.exists():
        os.rename(final, root / f".old_{final.name}_{files.new_nonce()}")
    os.rename(tmp, final)
    files.fsync_dir(root)
    return final


def _save_local(args, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
    start = time.perf_counter()
    root = local_dir(args, dist.get_rank())
    final, problem = None, None
    try:
        final = _write_local(args, root, iteration, consumed, model, optimizer, scheduler)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below and raises the same line
        problem = f"{type(exc).__name__}: {exc}"
    failed = _all_lines(problem)
    if failed:  # the previous one stays every rank's newest: the new one is dropped where it was written
        if final is not None:
            shutil.rmtree(final, ignore_errors=True)
        named = "; ".join(f"rank {r}: {line}" for r, line in failed)
        raise CheckpointError(f"the local non-persistent save of iteration {iteration} failed ({named}); every "
                              "rank keeps its previous local checkpoint")
    _remove_others(root, final.name)
    print_rank_0(f" saved local non-persistent checkpoint at iteration {iteration:8d} to "
                 f"{args.non_persistent_local_ckpt_dir}/rank_*/{final.name} ({dist.get_world_size()} ranks) in "
                 f"{time.perf_counter() - start:.3f} s")


# ------------------------------------------------------------------ load
@dataclasses.dataclass(frozen=True)
class Candidate:
    """The non-persistent checkpoint a load may take: its iteration, this rank's directory, its reader."""

    iteration: int
    directory: Path
    read_pieces: Callable = save_load._read_pieces


def _global_candidate(args) -> Tuple[Optional[Candidate], Optional[str]]:
    """The tracker's checkpoint of the global directory if it verifies (a collective), else why not."""
    root = global_dir(args, args.load)
    try:
        iteration = files.read_tracker(root) if root.is_dir() else None
        if iteration is None:
            return None, f"no {files.TRACKER} in {root}"
        directory = files.checkpoint_dir(root, iteration)
    except CheckpointError as exc:
        return None, str(exc)
    problems = save_load.checkpoint_problems(directory)
    if problems:
        return None, f"{directory} is damaged: {problems[0]}"
    return Candidate(iteration, directory), None


def _newest_local(root: Path, layout: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's newest complete local checkpoint: its iteration, whether its layout is this job's, problems."""
    found = sorted((p for p in root.glob("iter_*") if (p / MARKER).is_file()), reverse=True) if root.is_dir() else []
    if not found:
        return {"iteration": None}
    directory = found[0]
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError) as exc:
        return {"iteration": None, "problem": f"{directory / MARKER} is unreadable ({exc})"}
    saved = marker.get("parallel_layout", {})
    differs = [f"{k} {saved.get(k)!r} then, {v!r} now" for k, v in layout.items() if saved.get(k) != v]
    problems = manifest.verify(directory)
    return {"iteration": marker.get("iteration"), "layout": "; ".join(differs),
            "problem": f"{problems[0]}" if problems else None}


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _local_verdict(found: List[Dict[str, Any]], where: str) -> Tuple[Optional[int], Optional[str]]:
    """The iteration every rank may load, or why none (the same on every rank: ``found`` is gathered)."""
    for r, info in enumerate(found):
        if info.get("iteration") is not None and info.get("layout"):
            return None, f"it was saved with another layout ({info['layout']})"
    for r, info in enumerate(found):
        if info.get("problem"):
            return None, f"rank {r}'s is damaged: {info['problem']}"
    missing = [r for r, info in enumerate(found) if info.get("iteration") is None]
    if len(missing) == len(found):
        return None, f"no local checkpoint in {where}"
    if missing:
        verb = "holds" if len(missing) == 1 else "hold"
        return None, f"{_ranks(missing)} {verb} no complete local checkpoint in {where}"
    iterations = sorted({info["iteration"] for info in found})
    if len(iterations) > 1:
        by = {i: [r for r, info in enumerate(found) if info["iteration"] == i] for i in iterations}
        return None, "the ranks' newest complete local checkpoints differ (" + "; ".join(
            f"{_ranks(rs)}: iteration {i}" for i, rs in by.items()) + ")"
    return iterations[0], None


def _local_candidate(args) -> Tuple[Optional[Candidate], Optional[str]]:
    """The local checkpoint every rank holds, verified by each rank on its own files (a collective)."""
    layout = json.loads(json.dumps(save_load.parallel_layout(args)))
    root = local_dir(args, dist.get_rank())
    mine = _newest_local(root, layout)
    found: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    iteration, why = _local_verdict(found, args.non_persistent_local_ckpt_dir)
    if iteration is None:
        return None, why
    return Candidate(iteration, root / files.iteration_dir_name(iteration), _read_local), None


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return ("object", type(value).__name__)


def _read_local(state: Dict[str, Any], directory: Path, prefixes: Tuple[str, ...], reader=None) -> None:
    """Fill ``state`` from this rank's own files (each rank its own; the verdict on the keys is shared)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.tensor import DTensor

    problem = None
    try:
        # this rank's own file, checked against its manifest's CRC; its objects (the optimizer's hyperparameters,
        # pickled RNG states) are not all plain weights, as in DCP's own reader
        saved = torch.load(directory / PIECES, weights_only=False)
        flat, mapping = flatten_state_dict(state)
        local = {k: (v._local_tensor if isinstance(v, DTensor) else v) for k, v in flat.items()}
        missing = sorted(set(local) - set(saved))
        unexpected = sorted(k for k in saved if k.startswith(prefixes) and k not in local)
        wrong = sorted(k for k in set(local) & set(saved) if _describe(local[k]) != _describe(saved[k]))
        if missing or unexpected or wrong:
            problem = "; ".join(f"{what} {keys[:3]}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
                                for what, keys in (("missing", missing), ("unexpected", unexpected),
                                                   ("different shape or kind", wrong)) if keys)
        else:
            with torch.no_grad():
                for key, value in local.items():
                    if isinstance(value, torch.Tensor):
                        value.copy_(saved[key])
                    else:
                        set_element(state, mapping[key], saved[key])
    except Exception as exc:  # noqa: BLE001 - shared below: every rank raises the same line
        problem = f"{type(exc).__name__}: {exc}"
    failed = _all_lines(problem)
    if failed:
        raise CheckpointError(f"local checkpoint {directory} does not fit this model (rank {failed[0][0]}: "
                              f"{failed[0][1]})")


def _iteration_of(directory: Path) -> int:
    return int(re.search(r"iter_(\d+)", Path(directory).name).group(1))


def load_checkpoint(args, model, optimizer, scheduler) -> Tuple[int, int]:
    """``--load``: the newer of its checkpoint and the non-persistent one, said in one line with the reason."""
    if kind(args) is None:
        return save_load.load_checkpoint(args, model, optimizer, scheduler)
    start = time.perf_counter()
    persistent = paths.find_checkpoint(args, problems=save_load.checkpoint_problems)
    p_iter = None if persistent is None else _iteration_of(persistent)
    candidate, why_not = _global_candidate(args) if kind(args) == "global" else _local_candidate(args)
    label = f"the {kind(args)} non-persistent checkpoint"
    fallback = (f"loading --load {args.load}'s iteration {p_iter}" if p_iter is not None
                else f"no checkpoint in --load {args.load}: starting from scratch")
    if candidate is not None and args.ckpt_step is not None:
        print_rank_0(f" --ckpt-step {args.ckpt_step}: loading --load's iteration {args.ckpt_step}, not {label} of "
                     f"iteration {candidate.iteration}")
    elif candidate is not None and (p_iter is None or candidate.iteration >= p_iter):
        reason = (f"--load {args.load} holds none" if p_iter is None
                  else f"newer than --load's iteration {p_iter}" if candidate.iteration > p_iter
                  else f"as new as --load's iteration {p_iter} (Megatron-LM's rule: the non-persistent one)")
        where = candidate.directory if kind(args) == "global" else \
            f"{args.non_persistent_local_ckpt_dir}/rank_*/{candidate.directory.name}"
        print_rank_0(f" loading {label} {where} (iteration {candidate.iteration}): {reason}")
        return save_load.load_directory(args, model, optimizer, scheduler, candidate.directory, start,
                                        verify=False, read_pieces=candidate.read_pieces)
    elif candidate is not None:
        print_rank_0(f" {fallback}: {label} (iteration {candidate.iteration}) is older")
    else:
        print_rank_0(f" {label} is not used ({why_not}): {fallback}")
    if persistent is None:
        return 0, 0
    return save_load.load_directory(args, model, optimizer, scheduler, persistent, start)


def check_newer(args, start_iteration: int) -> None:
    """At start-up (rank 0's view): say when this run's first non-persistent save replaces newer ones."""
    if not getattr(args, "non_persistent_save_interval", None) or dist.get_rank() != 0:
        return
    root = global_dir(args, args.save) if kind(args) == "global" else local_dir(args, 0)
    saved = paths.complete_iterations(root, lambda d: (d / files.COMMON).is_file()) if root.is_dir() else []
    newer = [i for i in saved if i > start_iteration]
    if newer:
        print_rank_0(f" {root} holds non-persistent iteration(s) {', '.join(map(str, sorted(newer)))}, newer than "
                     f"iteration {start_iteration} this run starts from: its first non-persistent save replaces "
                     "them (only the newest is kept)")
