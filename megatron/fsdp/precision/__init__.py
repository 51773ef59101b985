"""Precision: which dtype each piece of state has (compute weights, main weights, gradients, optimizer moments).

Owns the mixed-precision policy (``mixed_precision``) and the lower-precision optimizer state with
its load-time dtype rule (``optimizer_state``), and FP8 numbers: formats, scales, amax histories and
the quantizers of each recipe (``fp8``).

May import: torch only.
"""
