"""Test-harness stand-ins for the packages Megatron-Bridge 0.6.2 imports unconditionally and this machine cannot
install: Transformer Engine and nvidia-resiliency-ext (and, when they are not installed, nvidia-modelopt and
megatron-energon). Never part of the installed package.

They are not put in ``sys.modules``: Megatron-Core probes ``import transformer_engine`` and would take its
Transformer Engine paths. ``install()`` wraps ``builtins.__import__`` so that only the listed Bridge modules (the
ones that import these packages at module level, for annotations, base classes or no-op hooks) receive a stand-in;
every other importer still gets ``ModuleNotFoundError``. A stand-in class raises when constructed or called.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import types
from typing import Any, Dict, Generic, Optional, Set, Tuple, TypeVar

IMPORTERS = {
    "transformer_engine": {"megatron.bridge.peft.lora_layers", "megatron.bridge.models.gpt_full_te_layer_autocast_spec"},
    "nvidia_resiliency_ext": {"megatron.bridge.training.pretrain", "megatron.bridge.training.inprocess_restart"},
    "modelopt": {"megatron.bridge.training.checkpointing", "megatron.bridge.training.gpt_step",
                 "megatron.bridge.training.train", "megatron.bridge.training.eval",
                 "megatron.bridge.training.post_training.distillation", "megatron.bridge.models.distillation_provider",
                 "megatron.bridge.models.conversion.auto_bridge"},
    "megatron.energon": {"megatron.bridge.data.energon.task_encoder_utils", "megatron.bridge.data.energon.metadata",
                         "megatron.bridge.data.energon.hf_task_encoder",
                         "megatron.bridge.data.energon.base_energon_datamodule",
                         "megatron.bridge.models.qwen_vl.data.energon",
                         "megatron.bridge.diffusion.data.wan.wan_taskencoder",
                         "megatron.bridge.diffusion.data.flux.flux_taskencoder",
                         "megatron.bridge.diffusion.data.common.diffusion_sample",
                         "megatron.bridge.diffusion.data.common.diffusion_energon_datamodule",
                         "megatron.bridge.diffusion.data.common.diffusion_task_encoder_with_sp"},
}
_TABLE: Dict[str, Tuple[Dict[str, types.ModuleType], Set[str]]] = {}
_IMPORT = builtins.__import__


class _Absent:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__qualname__}: a test stand-in, the real package is not installed")


class _Tree:
    """Stand-in modules by dotted name, each bound on its parent."""

    def __init__(self) -> None:
        self.modules: Dict[str, types.ModuleType] = {}

    def module(self, name: str) -> types.ModuleType:
        if name not in self.modules:
            self.modules[name] = types.ModuleType(name)
            parent, _, leaf = name.rpartition(".")
            if parent:
                setattr(self.module(parent), leaf, self.modules[name])
        return self.modules[name]

    def absent(self, module: str, *names: str) -> None:
        for name in names:
            setattr(self.module(module), name, type(name, (_Absent,), {"__module__": module}))

    def set(self, module: str, **values: Any) -> None:
        for name, value in values.items():
            setattr(self.module(module), name, value)


def _transformer_engine() -> Dict[str, types.ModuleType]:
    t = _Tree()
    t.set("transformer_engine", __version__="0.0.0+standin")
    t.absent("transformer_engine.pytorch", "Linear", "LayerNormLinear", "TransformerLayer", "LayerNorm", "RMSNorm")
    t.absent("transformer_engine.pytorch.ops", "Sequential", "Linear", "Dropout", "LayerNorm", "RMSNorm",
             "AddExtraInput", "ConstantScale", "MakeExtraOutput", "Quantize")
    t.module("transformer_engine.pytorch.fp8")
    return t.modules


def _resiliency() -> Dict[str, types.ModuleType]:
    t = _Tree()
    t.absent("nvidia_resiliency_ext.inprocess", "CallWrapper", "Wrapper", "Compose")
    for sub in ("rank_assignment", "finalize", "initialize", "nested_restarter", "abort", "state", "health_check"):
        t.module(f"nvidia_resiliency_ext.inprocess.{sub}")
    return t.modules


def _modelopt() -> Dict[str, types.ModuleType]:
    t = _Tree()
    plugin = "modelopt.torch.distill.plugins.megatron"

    @dataclasses.dataclass
    class DistillationConfig:  # Bridge subclasses it at import
        intermediate_layer_pairs: list = dataclasses.field(default_factory=list)
        logit_layers: tuple = ("output_layer", "output_layer")
        skip_lm_loss: bool = True
        kd_loss_scale: float = 1.0
        logit_kl_temperature: float = 1.0
        logit_kl_topk: Optional[int] = None
        criterion: Any = None
        loss_balancer: Any = None

    t.absent("modelopt.torch.distill", "DistillationModel", "convert")
    t.absent(plugin, "setup_distillation_config", "adjust_distillation_model_for_mcore")
    t.set(plugin, DistillationConfig=DistillationConfig,
          get_tensor_shapes_adjust_fn_for_distillation=lambda *a, **k: None)  # "not distilling"
    t.set("modelopt.torch.opt.plugins", save_modelopt_state=lambda *a, **k: None,
          restore_modelopt_state=lambda *a, **k: None, save_sharded_modelopt_state=lambda *a, **k: None)
    t.set("modelopt.torch.quantization.utils", is_quantized=lambda model: False)
    return t.modules


def _energon() -> Dict[str, types.ModuleType]:
    t = _Tree()
    S, TS, B, R, T = (TypeVar(n) for n in ("S", "TS", "B", "R", "T"))

    @dataclasses.dataclass
    class Sample:
        pass

    @dataclasses.dataclass
    class Batch:
        pass

    class DefaultTaskEncoder(Generic[S, TS, B, R]):
        pass

    class DefaultDecoderWebdatasetFactory(Generic[T]):
        pass

    class Cooker:
        def __init__(self, cook, **kwargs):
            self.cook = cook

    t.set("megatron.energon", Sample=Sample, Batch=Batch, SkipSample=type("SkipSample", (Exception,), {}),
          DefaultTaskEncoder=DefaultTaskEncoder)
    t.absent("megatron.energon", "WorkerConfig", "get_savable_loader", "get_train_dataset")
    t.set("megatron.energon.flavors.base_dataset", Sample=Sample)
    t.set("megatron.energon.flavors.webdataset", DefaultDecoderWebdatasetFactory=DefaultDecoderWebdatasetFactory)
    t.set("megatron.energon.task_encoder.base", stateless=lambda fn=None, **k: fn if fn is not None else (lambda f: f))
    t.set("megatron.energon.task_encoder.cooking", Cooker=Cooker, basic_sample_keys=lambda sample: {})
    t.absent("megatron.energon.epathlib.epath", "EPath")
    return t.modules


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals is not None:
        for root, (modules, importers) in _TABLE.items():
            if (name == root or name.startswith(root + ".")) and globals.get("__name__") in importers:
                if name not in modules:
                    raise ModuleNotFoundError(f"test stand-in has no {name}", name=name)
                top = name.split(".", 1)[0]
                if fromlist or top == root:
                    return modules[name if fromlist else top]
                return _IMPORT(top, globals, locals, None, 0)  # `import megatron.energon.x`: the real `megatron`
    return _IMPORT(name, globals, locals, fromlist, level)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def install() -> Dict[str, str]:
    """Install the import hook (idempotent); ``{package: "stand-in" | "installed"}``."""
    builders = {"transformer_engine": _transformer_engine, "nvidia_resiliency_ext": _resiliency,
                "modelopt": _modelopt, "megatron.energon": _energon}
    report = {}
    for package, build in builders.items():
        real = package in ("modelopt", "megatron.energon") and _installed(package)
        if not real and package not in _TABLE:
            _TABLE[package] = (build(), IMPORTERS[package])
        report[package] = "installed" if real else "stand-in"
    builtins.__import__ = _import
    return report
