"""megatron.fsdp: fully-sharded data parallelism for any ``nn.Module`` (torch only).

See docs/engine.md for the design. Public API::

    model = fully_shard(module, strategy="optim_grads_params", unit_modules=(Block,))
    optimizer = FullyShardedOptimizer(model, torch.optim.AdamW, lr=1e-3, clip_grad=1.0)
"""

from .checkpoint import load_model_state_dict, load_optimizer_state_dict, model_state_dict, optimizer_state_dict
from .checkpoint_metadata import check_checkpoint_keys
from .comm import CollectiveError, Ledger, LedgerEvent
from .experts import ExpertSharding
from .layout import FlatLayout, ParamSpec, build_layout
from .matrix_optimizer import TensorShards
from .mesh import DataParallelMesh, build_mesh
from .mixed_precision import MixedPrecision
from .build import fully_shard, megatron_no_weight_decay
from .module import FullyShardedModule, PersistentMemory
from .optimizer import FullyShardedOptimizer
from .precision_optimizer import OptimizerPrecision
from .runtime import Overlap
from .strategy import STRATEGIES, MeshStrategy, ShardingStrategy, parse_mesh_strategy, parse_strategy, valid_pairs
from .teardown import shutdown
from .unit import FSDPUnit, UnitState

__all__ = [
    "CollectiveError", "DataParallelMesh", "ExpertSharding", "MeshStrategy", "build_mesh", "parse_mesh_strategy", "valid_pairs",
    "FSDPUnit", "FlatLayout", "FullyShardedModule", "FullyShardedOptimizer", "Ledger", "LedgerEvent",
    "MixedPrecision", "Overlap", "ParamSpec", "PersistentMemory", "STRATEGIES", "ShardingStrategy", "UnitState",
    "build_layout", "fully_shard", "megatron_no_weight_decay", "parse_strategy",
    "check_checkpoint_keys", "load_model_state_dict", "load_optimizer_state_dict", "model_state_dict",
    "optimizer_state_dict", "OptimizerPrecision", "TensorShards", "shutdown",
]
