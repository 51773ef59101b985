"""megatron.fsdp: fully-sharded data parallelism for any ``nn.Module`` (torch only).

See docs/engine.md for the design. Public API::

    model = fully_shard(module, strategy="optim_grads_params", unit_modules=(Block,), overlap=Overlap())
    optimizer = FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, clip_grad=1.0)

FP8 parameter gathers (``precision/fp8.py`` is the math)::

    model = fully_shard(module, ..., mixed_precision=MixedPrecision(param_gather=QuantizedParamGather(recipe="mxfp8")))
    quantized_weight(param)  # -> QuantizedWeight (FP8 bytes + scales) while its unit is gathered, else None
"""

from .checkpoint.metadata import check_checkpoint_keys
from .checkpoint.state_dict import load_model_state_dict, load_optimizer_state_dict, model_state_dict, optimizer_state_dict
from .collectives.comm import CollectiveError, Ledger
from .collectives.teardown import shutdown
from .init.meta_init import MetaInit
from .optim.optimizer import FullyShardedOptimizer
from .optim.optimizer_options import GradNorm, LabelledGroups, PerMatrixOptimizer
from .precision.fp8 import QuantizedWeight
from .precision.mixed_precision import MixedPrecision
from .precision.optimizer_state import OptimizerPrecision
from .precision.param_gather import QuantizedParamGather
from .schedule.runtime import Overlap
from .sharding.experts import ExpertSharding
from .sharding.mesh import DataParallelMesh, build_mesh
from .sharding.quantized_gather import quantized_weight
from .wrap.build import fully_shard, megatron_no_weight_decay
from .wrap.module import FullyShardedModule, PersistentMemory

# The user's API. Internals (units, layouts, levels' parsers, the per-matrix shards) are imported from
# their modules: megatron.fsdp.schedule.unit, .sharding.layout, .sharding.strategy, .optim.matrix_optimizer.
__all__ = [
    # wrap and train
    "fully_shard", "FullyShardedModule", "FullyShardedOptimizer", "megatron_no_weight_decay",
    # policies
    "MixedPrecision", "QuantizedParamGather", "OptimizerPrecision", "Overlap", "ExpertSharding",
    "GradNorm", "PerMatrixOptimizer", "LabelledGroups", "MetaInit",
    # the mesh
    "DataParallelMesh", "build_mesh",
    # state dicts and checkpoints
    "model_state_dict", "optimizer_state_dict", "load_model_state_dict", "load_optimizer_state_dict",
    "check_checkpoint_keys",
    # FP8 weights
    "quantized_weight", "QuantizedWeight",
    # what a model reports, errors, teardown
    "PersistentMemory", "Ledger", "CollectiveError", "shutdown",
]
