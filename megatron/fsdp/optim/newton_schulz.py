"""Newton-Schulz orthogonalisation with one coefficient triple, or one triple per iteration.

``torch.optim.Muon`` runs every iteration with the same ``(a, b, c)``: Keller Jordan's
coefficients, ``"simple"`` in emerging_optimizers' names. Megatron-LM's
``--muon-coefficient-type`` chooses a set of triples applied one per iteration (``"quintic"``,
its default, and others), whose iterations reach singular values near 1 in fewer steps.
``newton_schulz`` runs either: a single triple is ``torch.optim._muon._zeropower_via_newtonschulz``
itself (bitwise), a sequence of ``steps`` triples is the same arithmetic (bf16 from the start,
the smaller dimension first, Frobenius normalisation) with the ``k``-th triple at iteration ``k``.

``COEFFICIENT_SETS`` holds the published sets under emerging_optimizers' names (values rounded
as there); ``per_step_coefficients`` expands one to a run of ``steps`` iterations as
emerging_optimizers does (cycling through the set; ``polar_express`` repeats its last triple).
"""

from __future__ import annotations

from itertools import chain, cycle, islice, repeat
from typing import Sequence, Tuple, Union

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

Triple = Tuple[float, float, float]

COEFFICIENT_SETS = {
    # Keller Jordan's Muon (torch.optim.Muon's defaults).
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Optimised for a quintic iteration (modded-nanogpt's train_gpt_medium.py, via leloykun).
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    # Polar Express (Amsel et al., arXiv:2505.16932): the last triple repeats after the eighth iteration.
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    # Thibaut Boissin's flash-newton-schulz coefficients.
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)),
}
_REPEAT_LAST = ("polar_express",)


def per_step_coefficients(name: str, steps: int) -> Union[Triple, Tuple[Triple, ...]]:
    """``name``'s coefficients for ``steps`` iterations: the triple itself for a set of one (torch's form),
    else ``steps`` triples."""
    if name not in COEFFICIENT_SETS:
        raise ValueError(f"Newton-Schulz coefficient type {name!r}: expected one of {', '.join(COEFFICIENT_SETS)}")
    sets = COEFFICIENT_SETS[name]
    if len(sets) == 1:
        return sets[0]
    source = chain(sets, repeat(sets[-1])) if name in _REPEAT_LAST else cycle(sets)
    return tuple(islice(source, steps))


def _is_triple(coefficients) -> bool:
    return len(coefficients) == 3 and all(isinstance(c, (int, float)) for c in coefficients)


def newton_schulz(matrix: torch.Tensor, coefficients: Union[Triple, Sequence[Triple]], steps: int,
                  eps: float) -> torch.Tensor:
    """The orthogonalised ``matrix`` in bf16 (``torch.optim.Muon``'s ``O``)."""
    if _is_triple(coefficients):
        return _zeropower_via_newtonschulz(matrix, tuple(coefficients), steps, eps)
    per_step = [tuple(c) for c in coefficients]
    if len(per_step) != steps or not all(len(c) == 3 for c in per_step):
        raise ValueError(f"Newton-Schulz: {len(per_step)} coefficient triples for {steps} iterations; give one "
                         "triple, or one per iteration")
    if matrix.dim() != 2:
        raise ValueError("Newton-Schulz needs a 2-D matrix")
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.bfloat16()
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for a, b, c in per_step:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
