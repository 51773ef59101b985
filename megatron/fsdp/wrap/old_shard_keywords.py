"""``fully_shard``'s keywords of the previous release, kept working for one release.

Each old keyword now lives in one value (``mesh``, ``Overlap``, ``MixedPrecision``, ``MetaInit``); passing it builds
or completes that value, with one ``DeprecationWarning`` per process naming the new form.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..warn_once import warn_once
from ..init.meta_init import MetaInit
from ..precision.mixed_precision import MixedPrecision
from ..schedule.runtime import Overlap

OVERLAP_KEYWORDS = ("forward_prefetch", "backward_prefetch", "reductions_in_flight")
META_INIT_KEYWORDS = ("device", "init_weights")
OLD_KEYWORDS = OVERLAP_KEYWORDS + META_INIT_KEYWORDS + ("process_group", "double_buffer", "param_gather")


def _checked(value, kind: type, keyword: str):
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{keyword} must be a megatron.fsdp.{kind.__name__}, got {type(value).__name__}")
    return value


def new_form(mesh, mixed_precision: Optional[MixedPrecision], overlap: Optional[Overlap],
             meta_init: Optional[MetaInit], deprecated: dict):
    """``(mesh, mixed_precision, overlap, meta_init)`` with the old keywords in ``deprecated`` moved into
    them: ``process_group`` is the mesh, ``double_buffer`` a field of ``Overlap`` (as the three prefetch
    keywords), ``param_gather`` a field of ``MixedPrecision``, ``device`` and ``init_weights`` the
    fields of ``MetaInit``."""
    unknown = sorted(set(deprecated) - set(OLD_KEYWORDS))
    if unknown:
        raise TypeError(f"fully_shard() got an unexpected keyword argument {unknown[0]!r}")
    overlap = _checked(overlap, Overlap, "overlap")
    mixed_precision = _checked(mixed_precision, MixedPrecision, "mixed_precision")
    meta_init = _checked(meta_init, MetaInit, "meta_init")
    if not deprecated:
        return mesh, mixed_precision, overlap, meta_init
    spelled = []
    prefetch = {k: deprecated[k] for k in OVERLAP_KEYWORDS if k in deprecated}
    if prefetch:
        if overlap is not None:
            raise ValueError(f"pass overlap=Overlap(...) or {', '.join(sorted(prefetch))}, not both")
        overlap = Overlap(**prefetch)
    if "double_buffer" in deprecated:  # it was its own keyword beside overlap: it completes one given
        overlap = dataclasses.replace(overlap or Overlap(), double_buffer=deprecated["double_buffer"])
    if prefetch or "double_buffer" in deprecated:
        spelled.append("overlap=Overlap(...)")
    if "process_group" in deprecated:
        if mesh is not None and deprecated["process_group"] is not None:
            raise ValueError("pass either process_group (a flat mesh) or mesh (two axes), not both")
        mesh = mesh if mesh is not None else deprecated["process_group"]
        spelled.append("mesh=<the process group>")
    if "param_gather" in deprecated:
        mixed_precision = dataclasses.replace(mixed_precision or MixedPrecision(),
                                              param_gather=deprecated["param_gather"])
        spelled.append("mixed_precision=MixedPrecision(param_gather=...)")
    old_init = {k: deprecated[k] for k in META_INIT_KEYWORDS if k in deprecated}
    if old_init:
        if meta_init is not None:
            raise ValueError(f"pass meta_init=MetaInit(...) or {', '.join(sorted(old_init))}, not both")
        meta_init = MetaInit(**old_init)
        spelled.append("meta_init=MetaInit(...)")
    warn_once(f"fully_shard({', '.join(f'{k}=' for k in sorted(deprecated))}...) is deprecated: "
              f"pass {', '.join(spelled)}", DeprecationWarning, stacklevel=4, key="fully_shard")
    return mesh, mixed_precision, overlap, meta_init
