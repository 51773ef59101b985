"""What the checkpointing component reads of a run: its flags as one frozen value (``CheckpointConfig``).

Built once from the validated arguments (``Trainer.setup``); save, load, the start-up checks and the non-persistent
checkpoints take it instead of the namespace. The run's arguments themselves travel only as the ``record``
a checkpoint stores and compares (``common.json``'s ``args``, torch_dist's ``args``).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping, Optional


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Megatron-LM's checkpoint flags of the same names, and the run's record.

    ``record``: the run's arguments as every checkpoint records them and compares them against the checkpoint's
    (the model's shape and numerics, the FP8 recipe, the parallel layout): a read-only copy taken when the view is
    built, after set-up has written what it decides (the vocabulary sizes), so what a checkpoint records cannot
    change under it.
    """

    save: Optional[str]
    load: Optional[str]
    ckpt_step: Optional[int]
    ckpt_format: Optional[str]
    async_save: bool
    finetune: bool
    no_load_optim: bool
    no_load_rng: bool
    weights_only_purpose: Optional[str]  # not a flag: a tool's reason to load the weights only (``compatibility``)
    train_iters: int
    dist_ckpt_optim_fully_reshardable: bool
    non_persistent_ckpt_type: Optional[str]
    non_persistent_save_interval: Optional[int]
    non_persistent_global_ckpt_dir: Optional[str]
    non_persistent_local_ckpt_dir: Optional[str]
    record: Mapping[str, Any] = dataclasses.field(compare=False, repr=False)

    @classmethod
    def from_args(cls, args) -> "CheckpointConfig":
        """Read from the validated arguments (``weights_only_purpose``: set by a tool, else None)."""
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.name not in ("weights_only_purpose", "record")}
        return cls(**fields, weights_only_purpose=getattr(args, "weights_only_purpose", None),
                   record=types.MappingProxyType(dict(vars(args))))

    def saving_to(self, save: str) -> "CheckpointConfig":
        """The same run saving into ``save`` instead (a global non-persistent save), recorded so."""
        return dataclasses.replace(self, save=save, record=types.MappingProxyType({**self.record, "save": save}))
