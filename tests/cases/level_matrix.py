"""Sampled parameter matrices: every value of every axis covered, not every combination.

A parity matrix that runs the full product of levels x world sizes x micro-batch counts
(or level pairs x mesh shapes x ...) spends most of its time re-proving what the other
cases already proved. ``covering`` keeps the product of the leading ``full`` axes (the
ones whose combinations matter: the level and the world size, the level pair) and
rotates the remaining axes over it: rotated axis ``k`` takes the value at
``(sum of the full-axis indices + k * row) mod its length``, ``row`` counting the passes
over the last full axis. Every value of a rotated axis then meets many values of each
full axis, and two rotated axes of coprime lengths meet in every combination once there
are enough cases.

``MFSDP_FULL_MATRIX=1`` gives the whole product instead (before a release).
"""

from __future__ import annotations

import itertools
import os
from typing import List, Sequence, Tuple

FULL_MATRIX_ENV = "MFSDP_FULL_MATRIX"


def full_matrix() -> bool:
    return os.environ.get(FULL_MATRIX_ENV, "") not in ("", "0")


def covering(*axes: Sequence, full: int = 1) -> List[Tuple]:
    """Cases over ``axes``: the product of the first ``full`` axes, the others rotated over it."""
    if full_matrix():
        return list(itertools.product(*axes))
    lead, rest = axes[:full], axes[full:]
    cases = []
    for case_index, indices in enumerate(itertools.product(*(range(len(a)) for a in lead))):
        row = case_index // len(lead[-1])  # passes over the last full axis
        rotated = tuple(axis[(sum(indices) + k * row) % len(axis)] for k, axis in enumerate(rest))
        cases.append(tuple(a[i] for a, i in zip(lead, indices)) + rotated)
    missing = [(k, v) for k, axis in enumerate(rest) for v in axis if v not in {c[full + k] for c in cases}]
    if missing:
        raise ValueError(f"too few cases to cover {missing}: make more axes full")
    return cases
