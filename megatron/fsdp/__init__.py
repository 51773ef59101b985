"""megatron.fsdp: fully-sharded data parallelism for any ``nn.Module`` (torch only).

See docs/engine.md for the design. Public API::

    model = fully_shard(module, strategy="optim_grads_params", unit_modules=(Block,))
    optimizer = FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, clip_grad=1.0)

FP8 parameter gathers (``precision/fp8.py`` is the math)::

    model = fully_shard(module, ..., param_gather=QuantizedParamGather(recipe="mxfp8"))
    quantized_weight(param)  # -> QuantizedWeight (FP8 bytes + scales) while its unit is gathered, else None
"""

from .checkpoint.state_dict import load_model_state_dict, load_optimizer_state_dict, model_state_dict, optimizer_state_dict
from .checkpoint.metadata import check_checkpoint_keys
from .collectives.comm import CollectiveError, Ledger, LedgerEvent
from .sharding.experts import ExpertSharding
from .sharding.layout import FlatLayout, ParamSpec, build_layout
from .optim.matrix_optimizer import TensorShards
from .sharding.mesh import DataParallelMesh, build_mesh
from .precision.mixed_precision import MixedPrecision
from .precision.param_gather import QuantizedParamGather
from .precision.fp8 import QuantizedWeight
from .sharding.quantized_gather import quantized_weight
from .wrap.build import fully_shard, megatron_no_weight_decay
from .wrap.module import FullyShardedModule, PersistentMemory
from .optim.optimizer import FullyShardedOptimizer
from .precision.optimizer_state import OptimizerPrecision
from .schedule.runtime import Overlap
from .sharding.strategy import STRATEGIES, MeshStrategy, ShardingStrategy, parse_mesh_strategy, parse_strategy, valid_pairs
from .collectives.teardown import shutdown
from .schedule.unit import FSDPUnit, UnitState

__all__ = [
    "CollectiveError", "DataParallelMesh", "ExpertSharding", "MeshStrategy", "build_mesh", "parse_mesh_strategy", "valid_pairs",
    "FSDPUnit", "FlatLayout", "FullyShardedModule", "FullyShardedOptimizer", "Ledger", "LedgerEvent",
    "MixedPrecision", "Overlap", "ParamSpec", "PersistentMemory", "STRATEGIES", "ShardingStrategy", "UnitState",
    "build_layout", "fully_shard", "megatron_no_weight_decay", "parse_strategy",
    "check_checkpoint_keys", "load_model_state_dict", "load_optimizer_state_dict", "model_state_dict",
    "optimizer_state_dict", "OptimizerPrecision", "TensorShards", "shutdown",
    "QuantizedParamGather", "QuantizedWeight", "quantized_weight",
]
