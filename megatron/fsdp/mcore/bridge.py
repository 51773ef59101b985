"""NVIDIA's Megatron-Bridge with this backend behind ``cfg.ddp.use_megatron_fsdp = True``.

    from megatron.fsdp.mcore import bridge
    bridge.install()
    pretrain(cfg, forward_step)          # megatron.bridge.training.pretrain

Bridge builds Megatron-FSDP through module-global names, as Megatron-LM's trainer does (the same wheel's
``megatron/training/models/dist_utils.py`` picks the class); ``install()`` rebinds them (``patches.PATCHES`` keeps the
record, ``uninstall()`` undoes it): the data-parallel class (and ``setup.py``'s ``isinstance`` that wires
``no_sync`` / ``start_grad_sync`` / ``start_param_sync``), ``finalize_model_grads`` (``setup.py``'s copy), the
default optimizer (``get_megatron_optimizer`` in
``training/optim.py``; an ``OptimizerConfig`` with its own ``provide()`` keeps it), the params norm, the
``fsdp_dtensor`` preprocessing (``trainer_backend.py``), and AutoBridge's ``unwrap_model``, export and import:
export reads full weights (``FullyShardedDataParallel.full_parameters``) at every level, import into a wrapped model
writes them back. NVIDIA's config fields keep their meanings (``ddp_fields.py``). Without CUDA it also makes Bridge's
``pretrain()`` run on CPU processes with gloo (``mcore_cpu.trainer_bridges.install_bridge``). docs/trainers.md.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .data_parallel import FullyShardedDataParallel
from .megatron_lm import require_megatron_training, use_this_backend as use_this_backend_in_megatron_training
from megatron.fsdp.mcore_cpu.patch_record import PATCHES, once, rebind, use_shipped_dataset_helpers
from .trainer_backend import fsdp_dtensor_preprocess_factory, optimizer_factory, params_norm_factory


class BridgeUnavailable(RuntimeError):
    """Megatron-Bridge does not import here."""


def _require_bridge() -> None:
    require_megatron_training()
    try:
        import megatron.bridge.training.setup  # noqa: F401
    except ImportError as error:
        raise BridgeUnavailable(f"Megatron-Bridge does not import ({error}): pip install megatron-bridge "
                                "(0.6.2 is the release this adapter is tested with)") from error


def _see_through(original):
    """Bridge's ``unwrap_model`` also unwraps this backend's class."""
    @functools.wraps(original)
    def unwrap_model(model, module_instances=None):
        def strip(module):
            module = original(module, module_instances)
            while isinstance(module, FullyShardedDataParallel):
                module = original(module.module, module_instances)
            return module
        return [strip(m) for m in model] if isinstance(model, list) else strip(model)
    return unwrap_model


@contextlib.contextmanager
def _full_modules(megatron_model, write_back: bool):
    """The chunks as Bridge's conversion walks them: each wrapped chunk's module holding its full weights
    (``full_parameters``), other chunks as they are. Bridge then takes the plain-module path (its Megatron-FSDP
    branch calls NVIDIA's ``install_optimized_model_weights``); ``write_back`` puts what it wrote into the shards."""
    chunks = list(megatron_model) if isinstance(megatron_model, (list, tuple)) else [megatron_model]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(c.full_parameters(write_back)) if isinstance(c, FullyShardedDataParallel) else c
               for c in chunks]


def _exporting_full_weights(original):
    """``stream_weights_megatron_to_hf`` (a generator) over full weights at every level, never empty shards."""
    @functools.wraps(original)
    def stream_weights_megatron_to_hf(self, megatron_model, *args, **kwargs):
        with _full_modules(megatron_model, write_back=False) as modules:
            yield from original(self, modules, *args, **kwargs)
    return stream_weights_megatron_to_hf


def _importing_into_shards(original):
    """``load_weights_hf_to_megatron`` into a wrapped model: written into full weights, then into every rank's shard."""
    @functools.wraps(original)
    def load_weights_hf_to_megatron(self, hf_pretrained, megatron_model, *args, **kwargs):
        with _full_modules(megatron_model, write_back=True) as modules:
            original(self, hf_pretrained, modules, *args, **kwargs)
        return megatron_model if isinstance(megatron_model, list) else [megatron_model]
    return load_weights_hf_to_megatron


def use_this_backend() -> None:
    if not once("bridge.backend"):
        return
    use_this_backend_in_megatron_training()  # the wheel's dist_utils picks the class for Bridge too
    from megatron.bridge.models.conversion import model_bridge, utils as conversion_utils
    from megatron.bridge.training import checkpointing, optim, train

    rebind("megatron_FSDP", FullyShardedDataParallel, "megatron.bridge.training.setup")
    import megatron.core.distributed as core_distributed  # rebound by use_this_backend_in_megatron_training above
    rebind("finalize_model_grads", core_distributed.finalize_model_grads, "megatron.bridge.training.setup")
    rebind("get_megatron_optimizer", optimizer_factory(PATCHES.original(optim, "get_megatron_optimizer")),
           "megatron.bridge.training.optim")
    rebind("calc_params_l2_norm", params_norm_factory(PATCHES.original(train, "calc_params_l2_norm")),
           "megatron.bridge.training.train", "megatron.bridge.training.utils.train_utils")
    rebind("preprocess_fsdp_dtensor_state_dict",
           fsdp_dtensor_preprocess_factory(PATCHES.original(checkpointing, "preprocess_fsdp_dtensor_state_dict")),
           "megatron.bridge.training.checkpointing")
    rebind("unwrap_model", _see_through(PATCHES.original(conversion_utils, "unwrap_model")),
           "megatron.bridge.models.conversion.utils", "megatron.bridge.models.conversion.model_bridge")
    bridge_class = model_bridge.MegatronModelBridge
    PATCHES.set(bridge_class, "stream_weights_megatron_to_hf",
                _exporting_full_weights(PATCHES.original(bridge_class, "stream_weights_megatron_to_hf")))
    PATCHES.set(bridge_class, "load_weights_hf_to_megatron",
                _importing_into_shards(PATCHES.original(bridge_class, "load_weights_hf_to_megatron")))


def install() -> None:
    """Make ``cfg.ddp.use_megatron_fsdp = True`` in Megatron-Bridge mean this backend (and run on CPU without CUDA).

    Idempotent; composes with an already enabled CPU mode and with ``megatron_lm.install()``.
    """
    _require_bridge()
    use_shipped_dataset_helpers("megatron.bridge.training.initialize")
    use_this_backend()
    if not torch.cuda.is_available():
        from megatron.fsdp.mcore_cpu.trainer_bridges import install_bridge

        install_bridge()


def uninstall() -> None:
    """Undo ``install()`` (CPU mode itself: ``cpu_mode.disable_cpu_mode``)."""
    PATCHES.restore()
