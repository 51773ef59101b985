"""Lower-precision optimizer state: Adam/AdamW moments and main gradients in bf16, the update in fp32.

What Megatron-LM calls the precision-aware optimizer (``--use-precision-aware-optimizer
--exp-avg-dtype --exp-avg-sq-dtype --main-grads-dtype``, Transformer Engine's ``FusedAdam``
on GPUs), written for the engine's few long flat shards so it runs anywhere:

* ``exp_avg`` / ``exp_avg_sq`` are stored in their own dtype (bf16 halves the 8 bytes per
  parameter of Adam's state). Each step reads a chunk of moments, gradient and main weights
  into fp32, updates in fp32 with the same operations as ``torch.optim.Adam``'s
  single-tensor path, and writes the moments back rounded to their dtype. Chunking keeps the
  step's temporaries at a few MiB however long a shard is.
* main gradients (the engine's gradient accumulators) may be bf16: the optimizer reads them
  from ``param.decoupled_grad`` (torch refuses a ``.grad`` whose dtype differs from the
  parameter's; Megatron-Core uses the same attribute name for the same reason).

The optimizer is a ``torch.optim.Adam`` subclass with Adam's own param-group keys and its
``step`` scalar state, so checkpoints of fp32 and bf16 state have the same keys and load
into each other (``converts_on_load``); the moment dtypes are class attributes
(``precision_aware_adam``) because the checkpoint code re-creates an optimizer from its class
to describe the state of one that has not stepped yet.

fp32 state with fp32 gradients (``OptimizerPrecision()``) is the default and, over fp32 main
weights, changes nothing: the caller's optimizer class runs exactly as before. Over bf16 main
weights (``MixedPrecision(main_dtype=torch.bfloat16)``) this optimizer always runs: the moments in
their own dtype (fp32 by default) and the update in fp32 (the caller's would compute in bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Optional, Union

import torch

CHUNK_ELEMENTS = 1 << 20  # elements updated at once: ~16 MiB of fp32 temporaries
SUPPORTED = (torch.float32, torch.bfloat16)
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _check_dtype(what: str, dtype) -> torch.dtype:
    if dtype not in SUPPORTED:
        raise ValueError(f"{what}={dtype!r}: supported are torch.float32 and torch.bfloat16")
    return dtype


@dataclasses.dataclass(frozen=True)
class OptimizerPrecision:
    """Dtypes of Adam's moments and of the main gradients the optimizer reads."""

    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    main_grads_dtype: Optional[torch.dtype] = None  # None: the main weights' dtype

    def __post_init__(self):
        _check_dtype("exp_avg_dtype", self.exp_avg_dtype)
        _check_dtype("exp_avg_sq_dtype", self.exp_avg_sq_dtype)
        if self.main_grads_dtype is not None:
            _check_dtype("main_grads_dtype", self.main_grads_dtype)

    @classmethod
    def of(cls, state_dtype: Union[None, torch.dtype, Mapping[str, torch.dtype]] = None,
           main_grads_dtype: Optional[torch.dtype] = None) -> "OptimizerPrecision":
        """From ``FullyShardedOptimizer``'s arguments: one dtype for both moments, or ``{key: dtype}``."""
        if state_dtype is None or isinstance(state_dtype, torch.dtype):
            both = state_dtype or torch.float32
            return cls(both, both, main_grads_dtype)
        unknown = sorted(set(state_dtype) - set(STATE_KEYS))
        if unknown:
            raise ValueError(f"state_dtype keys {unknown}: Adam's elementwise state is {list(STATE_KEYS)}")
        return cls(state_dtype.get("exp_avg", torch.float32), state_dtype.get("exp_avg_sq", torch.float32),
                   main_grads_dtype)

    def is_default(self, main_dtype: torch.dtype) -> bool:
        """Whether the caller's optimizer runs unchanged: over fp32 (or wider) main weights with state and
        gradients in their dtype. Over bf16 main weights the precision-aware Adam always runs, so that the
        update is computed in fp32 whatever the moments' dtype (the caller's would compute in bf16)."""
        return (main_dtype.itemsize >= 4 and self.exp_avg_dtype == main_dtype and self.exp_avg_sq_dtype == main_dtype
                and self.main_grads_dtype in (None, main_dtype))

    def optimizer_class(self, optimizer_cls, main_dtype: torch.dtype):
        """The class to instantiate: ``optimizer_cls`` itself by default, else the precision-aware Adam."""
        if self.is_default(main_dtype):
            return optimizer_cls
        if optimizer_cls not in (torch.optim.Adam, torch.optim.AdamW):
            name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
            raise ValueError(f"state_dtype / main_grads_dtype other than fp32 are implemented for "
                             f"torch.optim.Adam and torch.optim.AdamW, not {name}; use one of those or "
                             "keep fp32 state")
        cls = precision_aware_adam(self.exp_avg_dtype, self.exp_avg_sq_dtype)
        if optimizer_cls is torch.optim.AdamW:
            return functools.partial(cls, decoupled_weight_decay=True)
        return cls


def attach_grad(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """Give an optimizer tensor its gradient: ``.grad`` when the dtypes agree, else ``.decoupled_grad``."""
    if grad.dtype == weight.dtype:
        weight.grad = grad
    else:
        weight.decoupled_grad = grad


def detach_grad(weight: torch.Tensor) -> None:
    """Undo ``attach_grad`` (the gradient's storage is about to be released)."""
    weight.grad = None
    if hasattr(weight, "decoupled_grad"):
        weight.decoupled_grad = None


def converts_on_load(key: str, saved, wanted) -> bool:
    """An optimizer moment saved in one dtype may load into another (fp32 <-> bf16 state; DCP casts on read).

    ``key``: an optimizer state-dict key (``state.<param>.<moment>``, maybe under a prefix);
    dtypes as ``torch.dtype`` or their names (``"torch.bfloat16"``).
    """
    def dtype(d):
        return d if isinstance(d, torch.dtype) else getattr(torch, str(d).replace("torch.", ""), None)
    return (".state." in "." + key and key.rsplit(".", 1)[-1] in STATE_KEYS
            and dtype(saved) in SUPPORTED and dtype(wanted) in SUPPORTED)


class PrecisionAwareAdam(torch.optim.Adam):
    """``torch.optim.Adam`` (``decoupled_weight_decay=True``: AdamW) with moments in ``exp_avg_dtype``
    / ``exp_avg_sq_dtype`` and the arithmetic in fp32. Instantiate through ``precision_aware_adam``."""

    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 decoupled_weight_decay=False, **adam_flags):
        """``adam_flags``: the rest of ``torch.optim.Adam``'s keywords (``amsgrad``, ``foreach``, ``maximize``,
        ``capturable``, ``differentiable``, ``fused``), handed to it as they are (it refuses unknown ones);
        those this step does not implement are refused below when set."""
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=decoupled_weight_decay, **adam_flags)
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if any(group.get(flag) for group in self.param_groups):
                raise ValueError(f"{type(self).__name__} does not implement {flag}=True")
        if any(group.get("fused") for group in self.param_groups):
            raise ValueError(f"{type(self).__name__} has its own chunked step; leave fused unset")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None)
                if grad is None:
                    grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.exp_avg_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.exp_avg_sq_dtype)
                state["step"] += 1
                _adam_update(p.view(-1), grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                             state["step"].item(), group)
        return loss


def _adam_update(param, grad, exp_avg, exp_avg_sq, step: float, group) -> None:
    """One Adam step on flat tensors, chunk by chunk, in fp32 (torch's single-tensor order of operations)."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", False)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
    for lo in range(0, param.numel(), CHUNK_ELEMENTS):
        hi = min(lo + CHUNK_ELEMENTS, param.numel())
        w, m, v = param[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        g = grad[lo:hi].float()
        if weight_decay != 0:
            if decoupled:
                w.mul_(1 - lr * weight_decay)
            else:
                g = g.add(w, alpha=weight_decay)
        m32 = m if m.dtype == torch.float32 else m.float()
        v32 = v if v.dtype == torch.float32 else v.float()
        m32.lerp_(g, 1 - beta1)
        v32.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v32.sqrt() / bias_correction2_sqrt).add_(eps)
        w.addcdiv_(m32, denom, value=-step_size)
        if m32 is not m:
            m.copy_(m32)
        if v32 is not v:
            v.copy_(v32)


@functools.lru_cache(maxsize=None)
def precision_aware_adam(exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype) -> type:
    """The ``PrecisionAwareAdam`` class for these moment dtypes (one class per pair, cached)."""
    name = f"PrecisionAwareAdam_{_SHORT[exp_avg_dtype]}_{_SHORT[exp_avg_sq_dtype]}"
    return type(name, (PrecisionAwareAdam,), {"exp_avg_dtype": _check_dtype("exp_avg_dtype", exp_avg_dtype),
                                              "exp_avg_sq_dtype": _check_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype),
                                              "__module__": __name__})
