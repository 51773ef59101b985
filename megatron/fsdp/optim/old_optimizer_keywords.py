"""``FullyShardedOptimizer``'s keywords of the previous release, kept working for one release.

Each old keyword belongs to one option value; passing any of them builds that value, with one
``DeprecationWarning`` per process naming the new form.
"""

from __future__ import annotations

from typing import Dict

from ..warn_once import warn_once

from ..precision.optimizer_state import OptimizerPrecision
from .optimizer_options import GradNorm, LabelledGroups, PerMatrixOptimizer

# new keyword -> (its value's spelling in the warning, {old keyword: the value's field})
OLD_KEYWORDS: Dict[str, tuple] = {
    "grad_norm": ("GradNorm(...)", {"counts_in_norm": "counts_in_norm", "norm_groups": "groups",
                                    "expert_norm_groups": "expert_groups"}),
    "matrix": ("PerMatrixOptimizer(...)", {"matrix_optimizer": "optimizer", "matrix_kwargs": "kwargs",
                                           "matrix_params": "params", "matrix_shards": "shards",
                                           "matrix_split": "split"}),
    "precision": ("OptimizerPrecision(...)", {"state_dtype": "state_dtype", "main_grads_dtype": "main_grads_dtype"}),
    "labelled_groups": ("LabelledGroups(...)", {"param_group": "label", "group_options": "options"}),
}

def _build(new: str, fields: dict):
    if new == "grad_norm":
        return GradNorm(**fields)
    if new == "matrix":
        return PerMatrixOptimizer(**fields) if fields.get("optimizer") is not None else None
    if new == "precision":
        return OptimizerPrecision.of(fields.get("state_dtype"), fields.get("main_grads_dtype"))
    return LabelledGroups(**fields)


def take_old_keywords(given: Dict[str, object], optimizer_kwargs: dict) -> Dict[str, object]:
    """The option values ``given`` (new keyword -> value or None), with those the old keywords in
    ``optimizer_kwargs`` spell built from them (the old keywords are removed from it)."""
    out, used, spelled = dict(given), [], []
    for new, (spelling, fields) in OLD_KEYWORDS.items():
        old = {name: optimizer_kwargs.pop(name) for name in list(fields) if name in optimizer_kwargs}
        if not old:
            continue
        if given.get(new) is not None:
            raise ValueError(f"pass {new}={spelling} or {', '.join(sorted(old))}, not both")
        out[new] = _build(new, {fields[name]: value for name, value in old.items()})
        used += sorted(old)
        spelled.append(f"{new}={spelling}")
    if used:
        warn_once(f"FullyShardedOptimizer({', '.join(f'{k}=' for k in used)}...) is deprecated: "
                  f"pass {', '.join(spelled)}", DeprecationWarning, stacklevel=3, key="FullyShardedOptimizer")
    return out

