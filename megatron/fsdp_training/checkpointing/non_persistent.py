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
  checkpoint is loaded at the newest iteration every rank holds complete whose files verify (a save killed on
  one rank after another completed it leaves the previous one complete everywhere), written with this job's
  layout (world size, TP/PP/CP/EP, levels); otherwise one line says why not and which checkpoint is loaded
  instead. ``--ckpt-step`` names a persistent checkpoint: that one is loaded. A ``--load`` whose
  ``non_persistent/`` holds a global checkpoint is compared so even without the flags (said in the line).

Non-persistent saves never write into ``--save``'s ``iter_*`` directories, so they never overwrite a
persistent checkpoint; a non-persistent one that is newer than the run's start is replaced by its first
non-persistent save, said at start-up (``check_newer``). A non-persistent directory outside ``--save`` is
owned like it: a lock while the job runs, and an owner file naming the job's ``--save``, so that a directory
holding another job's checkpoints (another run's ``--save``, another job's local checkpoints) is refused
(``paths.non_persistent_owner_problem``). The flags and their start-up rules are in
``arguments/checkpointing_flags.py``.
"""

from __future__ import annotations

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
from .checkpoint_config import CheckpointConfig
from .files import CheckpointError
from ..logs.lines import print_rank_0

MARKER = "local_complete.json"  # a local checkpoint's completeness marker (written last, before the rename)
PIECES = "pieces.pt"  # this rank's pieces of a local checkpoint
_held: List[Path] = []  # the directories whose lock this process holds (``hold``)


def due(config: CheckpointConfig, iteration: int) -> bool:
    """A non-persistent save at ``iteration`` (the loop asks only when no persistent save runs there)."""
    interval = config.non_persistent_save_interval
    return bool(config.save and interval and iteration % interval == 0)


def global_dir(config: CheckpointConfig, base: Optional[str]) -> Optional[Path]:
    """``--non-persistent-global-ckpt-dir``, else ``base/non_persistent`` (``base``: --save or --load)."""
    if config.non_persistent_global_ckpt_dir:
        return Path(config.non_persistent_global_ckpt_dir)
    return None if base is None else Path(base) / paths.NON_PERSISTENT_SUBDIR


def local_dir(config: CheckpointConfig, rank: int) -> Path:
    return Path(config.non_persistent_local_ckpt_dir) / f"rank_{rank:05d}"


def _owners(config: CheckpointConfig) -> List[str]:
    return paths.non_persistent_owners(config.save, config.load, saving=bool(config.non_persistent_save_interval))


def _all_lines(mine: Optional[str]) -> List[Tuple[int, str]]:
    """Every rank's line (a collective): ``(rank, line)`` of the ranks that have one, the same on every rank."""
    gathered: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [(r, line) for r, line in enumerate(gathered) if line]


# ------------------------------------------------------------------ the locks
def _write_targets(config: CheckpointConfig) -> List[Tuple[str, Path]]:
    """The directories this rank writes non-persistent checkpoints to, with their flag (none when not saving).
    The default global directory lies inside ``--save``, whose lock covers it."""
    if not config.non_persistent_save_interval:
        return []
    if config.non_persistent_ckpt_type == "local":
        return [("--non-persistent-local-ckpt-dir", local_dir(config, dist.get_rank()))]
    if dist.get_rank() == 0 and config.non_persistent_global_ckpt_dir:
        return [("--non-persistent-global-ckpt-dir", global_dir(config, config.save))]
    return []


def hold(config: CheckpointConfig) -> None:
    """At start-up (all ranks, a collective): lock the non-persistent directories this job writes, as ``--save``'s
    (``ownership.acquire_save_lock``), and name this job their owner. A directory holding another job's
    checkpoints (``paths.non_persistent_owner_problem``), one that cannot be written or that another live job
    holds stops every rank with the same line, before anything is written there."""
    problem = None
    notes = []
    for flag, directory in _write_targets(config):
        problem = paths.non_persistent_owner_problem(directory, flag, _owners(config), saving=True)
        if problem:
            break
        try:
            directory.mkdir(parents=True, exist_ok=True)
            problem, note = ownership.acquire_save_lock(directory, label=f"{flag} {directory}",
                                                        fix=f"pass another {flag}")
            if note:
                notes.append(note)
            if problem:
                break
            _held.append(directory)
            removed = paths.remove_stale_temporaries(directory)
            if removed:
                notes.append(f" removed {len(removed)} unfinished save(s) of a dead job from {directory}")
            if ownership.directory_owner(directory) is None:
                ownership.claim_directory(directory, config.save)
        except OSError as exc:
            problem = f"{flag} {directory} is not writable ({exc.strerror or exc}); choose a writable directory"
    if notes:
        print("\n".join(notes), flush=True)
    failed = _all_lines(problem)
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")


def release() -> None:
    """At the end of the job (this process; no collective): the directories ``hold`` locked."""
    while _held:
        ownership.release_save_lock(_held.pop())


# ------------------------------------------------------------------ save
def save(config: CheckpointConfig, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
    """The non-persistent save of ``iteration`` (all ranks)."""
    if config.non_persistent_ckpt_type == "global":
        _save_global(config, iteration, consumed, model, optimizer, scheduler)
    else:
        _save_local(config, iteration, consumed, model, optimizer, scheduler)


def _save_global(config: CheckpointConfig, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
    root = global_dir(config, config.save)
    final = save_load.save_checkpoint(config.saving_to(str(root)), iteration, consumed, model, optimizer, scheduler)
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


def _marker(config: CheckpointConfig, iteration: int) -> Dict[str, Any]:
    return {"iteration": iteration, "rank": dist.get_rank(),
            "parallel_layout": save_load.parallel_layout(config.record)}


# One torch.save file: ~470 bytes of zip framing per piece (measured on the tests' model, 122 pieces).
LOCAL_ITEM_OVERHEAD = 512


def _local_bytes(pieces: Dict[str, Any]) -> int:
    """What ``torch.save`` of ``pieces`` (and the small files beside it) takes on disk, a little over (1.08x the
    bytes written on the tests' model, where the framing weighs most)."""
    size = save_load.FIXED_OVERHEAD
    for value in pieces.values():
        size += LOCAL_ITEM_OVERHEAD + (value.nbytes if isinstance(value, torch.Tensor) else
                                           len(value) if isinstance(value, (bytes, bytearray)) else 256)
    return size


def _space_problem(root: Path, iteration: int, pieces: Dict[str, Any]) -> Optional[str]:
    try:
        root.mkdir(parents=True, exist_ok=True)
        return paths.space_problem(root, iteration, _local_bytes(pieces), paths.free_bytes(root),
                                   flag="--non-persistent-local-ckpt-dir")
    except OSError as exc:
        return f"cannot save to {root}: {exc.strerror or exc}"


def _write_local(config: CheckpointConfig, root: Path, iteration: int, consumed: int, pieces: Dict[str, Any],
                 scheduler) -> Path:
    """This rank alone: its pieces, ``common.json``, the marker and a manifest in a temporary, renamed into place;
    a failed write removes the temporary (running out of space: one line)."""
    paths.remove_stale_temporaries(root)
    tmp = files.temporary_dir(root, iteration, files.new_nonce())
    try:
        ownership.write_owner(tmp)
        with open(tmp / PIECES, "wb") as f:
            torch.save(pieces, f)
            f.flush()
            os.fsync(f.fileno())
        files.write_common(tmp, save_load.common_record(config.record, iteration, consumed, scheduler))
        files.write_file_durably(tmp / MARKER, json.dumps(_marker(config, iteration), sort_keys=True))
        manifest.write_manifest(tmp, {}, extra=[PIECES, files.COMMON, MARKER])
        files.fault_point("in_local_write", iteration, dist.get_rank())
        (tmp / ownership.OWNER).unlink(missing_ok=True)
        files.fsync_dir(tmp)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and paths.is_out_of_space(exc, root):
            raise CheckpointError(f"saving iteration {iteration} to {root} ran out of space (ENOSPC): "
                                  f"{paths.free_bytes(root)} bytes are free; the partial save was removed") from None
        raise
    final = root / files.iteration_dir_name(iteration)
    if final.exists():
        os.rename(final, root / f".old_{final.name}_{files.new_nonce()}")
    os.rename(tmp, final)
    files.fsync_dir(root)
    return final


def _failure(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _save_local(config: CheckpointConfig, iteration: int, consumed: int, model, optimizer, scheduler) -> None:
    """Every rank writes its own files; the ranks agree first that each has the space (nothing written otherwise),
    then that each completed the save; only then does each drop its older one."""
    start = time.perf_counter()
    root = local_dir(config, dist.get_rank())
    pieces = _local_pieces(save_steps.host_copies(save_load.save_state_dict(model, optimizer)))
    short = _all_lines(_space_problem(root, iteration, pieces))
    if short:
        named = "; ".join(f"rank {r}: {line}" for r, line in short)
        raise CheckpointError(f"the local non-persistent save of iteration {iteration} was not started ({named}); "
                              "every rank keeps its previous local checkpoint")
    final, problem = None, None
    try:
        final = _write_local(config, root, iteration, consumed, pieces, scheduler)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below and raises the same line
        problem = _failure(exc)
    failed = _all_lines(problem)
    if failed:  # the previous one stays every rank's newest: the new one is dropped where it was written
        if final is not None:
            shutil.rmtree(final, ignore_errors=True)
        named = "; ".join(f"rank {r}: {line}" for r, line in failed)
        raise CheckpointError(f"the local non-persistent save of iteration {iteration} failed ({named}); every "
                              "rank keeps its previous local checkpoint")
    _remove_others(root, final.name)
    print_rank_0(f" saved local non-persistent checkpoint at iteration {iteration:8d} to "
                 f"{config.non_persistent_local_ckpt_dir}/rank_*/{final.name} ({dist.get_world_size()} ranks) in "
                 f"{time.perf_counter() - start:.3f} s")


# ------------------------------------------------------------------ load
@dataclasses.dataclass(frozen=True)
class Candidate:
    """The non-persistent checkpoint a load may take: its iteration, this rank's directory, its reader, and what
    the load line adds about it (newer local iterations not every rank holds)."""

    iteration: int
    directory: Path
    read_pieces: Callable = save_load._read_pieces
    note: str = ""


def _global_candidate(config: CheckpointConfig) -> Tuple[Optional[Candidate], Optional[str]]:
    """The tracker's checkpoint of the global directory if it verifies (a collective), else why not."""
    root = global_dir(config, config.load)
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


def _complete_local(root: Path) -> List[int]:
    """The iterations of this rank's complete local checkpoints (marker present), newest first."""
    return paths.complete_iterations(root, lambda d: (d / MARKER).is_file()) if root.is_dir() else []


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _common_iterations(held: List[List[int]], where: str) -> Tuple[List[int], Optional[str]]:
    """The iterations every rank holds complete, newest first, or why there is none (the same on every rank:
    ``held`` is gathered). A save killed on one rank after another finished leaves the ranks' newest apart, but
    the previous one complete on every rank: that is the one to load."""
    missing = [r for r, its in enumerate(held) if not its]
    if len(missing) == len(held):
        return [], f"no local checkpoint in {where}"
    if missing:
        verb = "holds" if len(missing) == 1 else "hold"
        return [], f"{_ranks(missing)} {verb} no complete local checkpoint in {where}"
    common = sorted(set.intersection(*(set(its) for its in held)), reverse=True)
    if not common:
        return [], "no iteration is complete on every rank (" + "; ".join(
            f"rank {r}: {', '.join(map(str, its))}" for r, its in enumerate(held)) + ")"
    return common, None


def _not_everywhere(held: List[List[int]], chosen: int) -> str:
    """The newer iterations some ranks hold and others lack (what a save killed on one rank leaves)."""
    newer = sorted({i for its in held for i in its if i > chosen})
    if not newer:
        return ""
    parts = [f"{i} (missing on {_ranks([r for r, its in enumerate(held) if i not in its])})" for i in newer]
    return f"; newer iterations not complete on every rank: {', '.join(parts)}"


def _layout_difference(directory: Path, layout: Dict[str, Any]) -> Optional[str]:
    """How the layout this rank's local checkpoint ``directory`` was written with differs from this job's (its
    marker), or None (the same; an unreadable marker is ``_local_problem``'s)."""
    try:
        saved = json.loads((directory / MARKER).read_text()).get("parallel_layout", {})
    except (OSError, ValueError, AttributeError):
        return None
    differs = [f"{k} {saved.get(k)!r} then, {v!r} now" for k, v in layout.items() if saved.get(k) != v]
    return "; ".join(differs) or None


def _local_problem(directory: Path, layout: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """What keeps this rank's local checkpoint ``directory`` from loading: ``("layout", differences)`` or
    ``("damaged", the first problem)``; None when it fits and verifies."""
    try:
        json.loads((directory / MARKER).read_text())
    except (OSError, ValueError) as exc:
        return "damaged", f"{directory / MARKER} is unreadable ({exc})"
    differs = _layout_difference(directory, layout)
    if differs:
        return "layout", differs
    problems = manifest.verify(directory)
    return ("damaged", problems[0]) if problems else None


def _local_candidate(config: CheckpointConfig) -> Tuple[Optional[Candidate], Optional[str]]:
    """The newest local checkpoint every rank holds complete and verifies, each rank on its own files (collectives).
    A rank directory owned by another job stops the load (``paths.non_persistent_owner_problem``)."""
    root = local_dir(config, dist.get_rank())
    foreign = _all_lines(paths.non_persistent_owner_problem(root, "--non-persistent-local-ckpt-dir", _owners(config),
                                                            saving=bool(config.non_persistent_save_interval)))
    if foreign:
        raise CheckpointError(f"rank {foreign[0][0]}: {foreign[0][1]}")
    layout = json.loads(json.dumps(save_load.parallel_layout(config.record)))
    mine = _complete_local(root)
    newest = _layout_difference(root / files.iteration_dir_name(mine[0]), layout) if mine else None
    gathered: List[Optional[Tuple[List[int], Optional[str]]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, newest))
    layouts = [differs for _, differs in gathered if differs]
    if layouts:  # written by a job of another layout (a world size of its own: some ranks may hold none)
        return None, f"it was saved with another layout ({layouts[0]})"
    held = [its for its, _ in gathered]
    common, why = _common_iterations(held, config.non_persistent_local_ckpt_dir)
    damaged = []
    for iteration in common:  # newest first; the verdict on each is gathered, so every rank walks the same list
        directory = root / files.iteration_dir_name(iteration)
        found: List[Optional[Tuple[str, str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(found, _local_problem(directory, layout))
        layouts = [problem[1] for problem in found if problem and problem[0] == "layout"]
        if layouts:
            return None, f"it was saved with another layout ({layouts[0]})"
        bad = [(r, problem[1]) for r, problem in enumerate(found) if problem]
        if not bad:
            skipped = "".join(f"; iteration {i} is damaged on rank {r}: {text}" for i, r, text in damaged)
            return Candidate(iteration, directory, _read_local, _not_everywhere(held, iteration) + skipped), None
        damaged.append((iteration, *bad[0]))
    if damaged:
        _, r, text = damaged[0]
        older = (f"; so are the older iterations every rank holds ({', '.join(str(d[0]) for d in damaged[1:])})"
                 if len(damaged) > 1 else "")
        return None, f"rank {r}'s is damaged: {text}{older}"
    return None, why


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return ("object", type(value).__name__)


def _read_local(state: Dict[str, Any], directory: Path, prefixes: Tuple[str, ...], reader=None,
                unread=lambda key: False) -> None:
    """Fill ``state`` from this rank's own files (each rank its own; the verdict on the keys is shared);
    ``unread(key)``: saved keys this load leaves (``save_load.validate_keys``)."""
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
        unexpected = sorted(k for k in saved if k.startswith(prefixes) and k not in local and not unread(k))
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


def _found_without_type(config: CheckpointConfig) -> bool:
    """``--load``'s ``non_persistent/`` holds global non-persistent checkpoints though no type was given (a run
    that saved them, restarted without the flags): they are compared all the same, said in the load line."""
    return (config.non_persistent_ckpt_type is None
            and (Path(config.load) / paths.NON_PERSISTENT_SUBDIR / files.TRACKER).is_file())


def load_checkpoint(config: CheckpointConfig, model, optimizer, scheduler) -> Tuple[int, int]:
    """``--load``: the newer of its checkpoint and the non-persistent one, said in one line with the reason."""
    implicit = _found_without_type(config)
    which = "global" if implicit else config.non_persistent_ckpt_type
    if which is None:
        return save_load.load_checkpoint(config, model, optimizer, scheduler)
    start = time.perf_counter()
    persistent = paths.find_checkpoint(config.load, config.ckpt_step, problems=save_load.checkpoint_problems)
    p_iter = None if persistent is None else _iteration_of(persistent)
    candidate, why_not = _global_candidate(config) if which == "global" else _local_candidate(config)
    label = f"the {which} non-persistent checkpoint"
    found = (f" (found in --load {config.load}/{paths.NON_PERSISTENT_SUBDIR} without --non-persistent-ckpt-type: "
             "compared as with --non-persistent-ckpt-type global)") if implicit else ""
    fallback = (f"loading --load {config.load}'s iteration {p_iter}" if p_iter is not None
                else f"no checkpoint in --load {config.load}: starting from scratch")
    if candidate is not None and config.ckpt_step is not None:
        print_rank_0(f" --ckpt-step {config.ckpt_step}: loading --load's iteration {config.ckpt_step}, not {label} "
                     f"of iteration {candidate.iteration}{found}")
    elif candidate is not None and (p_iter is None or candidate.iteration >= p_iter):
        reason = (f"--load {config.load} holds none" if p_iter is None
                  else f"newer than --load's iteration {p_iter}" if candidate.iteration > p_iter
                  else f"as new as --load's iteration {p_iter} (Megatron-LM's rule: the non-persistent one)")
        where = candidate.directory if which == "global" else \
            f"{config.non_persistent_local_ckpt_dir}/rank_*/{candidate.directory.name}"
        print_rank_0(f" loading {label} {where} (iteration {candidate.iteration}): {reason}{candidate.note}{found}")
        return save_load.load_directory(config, model, optimizer, scheduler, candidate.directory, start,
                                        verify=False, read_pieces=candidate.read_pieces)
    elif candidate is not None:
        print_rank_0(f" {fallback}: {label} (iteration {candidate.iteration}) is older{found}")
    else:
        print_rank_0(f" {label} is not used ({why_not}): {fallback}{found}")
    if persistent is None:
        return 0, 0
    return save_load.load_directory(config, model, optimizer, scheduler, persistent, start)


def check_newer(config: CheckpointConfig, start_iteration: int) -> None:
    """At start-up (rank 0's view): say when this run's first non-persistent save replaces newer ones."""
    if not config.non_persistent_save_interval or dist.get_rank() != 0:
        return
    root = global_dir(config, config.save) if config.non_persistent_ckpt_type == "global" else local_dir(config, 0)
    saved = paths.complete_iterations(root, lambda d: (d / files.COMMON).is_file()) if root.is_dir() else []
    newer = [i for i in saved if i > start_iteration]
    if newer:
        print_rank_0(f" {root} holds non-persistent iteration(s) {', '.join(map(str, sorted(newer)))}, newer than "
                     f"iteration {start_iteration} this run starts from: its first non-persistent save replaces "
                     "them (only the newest is kept)")
