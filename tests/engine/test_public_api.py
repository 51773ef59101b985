"""``megatron.fsdp``'s public API is the user's: what wraps and trains a model, its policies, the mesh,
state dicts and checkpoint checks, FP8 weights, and what a model reports. Internals (units, layouts,
the levels' parsers) are imported from their modules. The API is in docs/engine.md, "API".
"""

import inspect
import warnings

import pytest
import torch

import megatron.fsdp as mfsdp
import megatron.fsdp.warn_once as warn_once
import megatron.fsdp.wrap.old_shard_keywords as old_shard_keywords

PUBLIC = [
    "fully_shard", "FullyShardedModule", "FullyShardedOptimizer", "megatron_no_weight_decay",
    "MixedPrecision", "QuantizedParamGather", "OptimizerPrecision", "Overlap", "ExpertSharding",
    "GradNorm", "PerMatrixOptimizer", "LabelledGroups", "MetaInit",
    "DataParallelMesh", "build_mesh",
    "model_state_dict", "optimizer_state_dict", "load_model_state_dict", "load_optimizer_state_dict",
    "check_checkpoint_keys",
    "quantized_weight", "QuantizedWeight",
    "PersistentMemory", "Ledger", "CollectiveError", "shutdown",
]


def test_all_is_the_users_api():
    assert mfsdp.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(mfsdp, name) is not None
    for internal in ("FSDPUnit", "UnitState", "FlatLayout", "ParamSpec", "build_layout", "TensorShards",
                     "valid_pairs", "STRATEGIES", "ShardingStrategy", "MeshStrategy", "parse_strategy",
                     "parse_mesh_strategy", "LedgerEvent"):
        assert not hasattr(mfsdp, internal), internal


def test_fully_shard_takes_an_overlap():
    params = list(inspect.signature(mfsdp.fully_shard).parameters)
    assert params == ["module", "strategy", "unit_modules", "mesh", "mixed_precision", "no_weight_decay",
                      "outer_strategy", "average_grads", "experts", "overlap", "meta_init", "deprecated"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=mfsdp.Overlap(forward_prefetch=2))
    assert model.overlap == mfsdp.Overlap(forward_prefetch=2)
    assert mfsdp.fully_shard(torch.nn.Linear(2, 2)).overlap == mfsdp.Overlap()


def test_old_overlap_keywords_warn_once(monkeypatch):
    monkeypatch.setattr(warn_once, "_said", set())
    with pytest.warns(DeprecationWarning, match=r"pass overlap=Overlap\(\.\.\.\)") as record:
        model = mfsdp.fully_shard(torch.nn.Linear(2, 2), forward_prefetch=0, reductions_in_flight=3)
        mfsdp.fully_shard(torch.nn.Linear(2, 2), backward_prefetch=0)
    assert len([w for w in record if issubclass(w.category, DeprecationWarning)]) == 1
    assert model.overlap == mfsdp.Overlap(forward_prefetch=0, reductions_in_flight=3)
    with pytest.raises(ValueError, match="not both"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=mfsdp.Overlap(), forward_prefetch=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetch'"):
        mfsdp.fully_shard(torch.nn.Linear(2, 2), prefetch=0)


def test_old_mesh_buffer_and_gather_keywords_move_into_their_values(monkeypatch):
    monkeypatch.setattr(warn_once, "_said", set())
    gather = mfsdp.QuantizedParamGather(recipe="mxfp8")
    mp = mfsdp.MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.warns(DeprecationWarning, match=r"fully_shard\(double_buffer=, param_gather=, process_group=\.\.\.\) "
                      r"is deprecated: pass overlap=Overlap\(\.\.\.\), mesh=<the process group>, "
                      r"mixed_precision=MixedPrecision\(param_gather=\.\.\.\)"):
        mesh, got_mp, overlap, _ = old_shard_keywords.new_form(
            None, mp, mfsdp.Overlap(forward_prefetch=2),
            None, dict(process_group="group", double_buffer=True, param_gather=gather))
    assert mesh == "group" and overlap == mfsdp.Overlap(forward_prefetch=2, double_buffer=True)
    assert got_mp == mfsdp.MixedPrecision(param_dtype=torch.bfloat16, param_gather=gather)
    with pytest.raises(ValueError, match="not both"):
        old_shard_keywords.new_form(mfsdp.DataParallelMesh(), None, None, None, dict(process_group="group"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mfsdp.fully_shard(torch.nn.Linear(2, 2), overlap=mfsdp.Overlap(double_buffer=True))
    assert model.overlap.double_buffer


def test_optimizer_takes_one_value_per_concern():
    params = list(inspect.signature(mfsdp.FullyShardedOptimizer).parameters)
    assert params == ["models", "optimizer_cls", "clip_grad", "no_weight_decay", "grad_norm", "matrix", "precision",
                      "labelled_groups", "optimizer_kwargs"]


def test_old_optimizer_keywords_warn_once(monkeypatch):
    monkeypatch.setattr(warn_once, "_said", set())
    model = mfsdp.fully_shard(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)))
    labels = dict(param_group=lambda n, p: "norm" if n.startswith("1.") else "", group_options={"norm": {"lr": 0.5}})
    with pytest.warns(DeprecationWarning, match=r"pass grad_norm=GradNorm\(\.\.\.\), precision=OptimizerPrecision"
                      r"\(\.\.\.\), labelled_groups=LabelledGroups\(\.\.\.\)") as record:
        opt = mfsdp.FullyShardedOptimizer(model, torch.optim.Adam, lr=0.1, norm_groups=(), state_dtype=torch.bfloat16,
                                          **labels)
        again = mfsdp.FullyShardedOptimizer(model, torch.optim.Adam, lr=0.1, main_grads_dtype=torch.bfloat16)
    assert len([w for w in record if issubclass(w.category, DeprecationWarning)]) == 1
    assert opt.precision == mfsdp.OptimizerPrecision(torch.bfloat16, torch.bfloat16)
    assert again.precision == mfsdp.OptimizerPrecision(main_grads_dtype=torch.bfloat16)
    assert opt.group_labels[2:] == [("norm", False), ("norm", True)] and opt.param_groups[3]["lr"] == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = mfsdp.FullyShardedOptimizer(model, torch.optim.Adam, lr=0.1, precision=opt.precision,
                                          labelled_groups=mfsdp.LabelledGroups(labels["param_group"],
                                                                               labels["group_options"]))
    assert new.group_labels == opt.group_labels and new.precision == opt.precision
    with pytest.raises(ValueError, match="not both"):
        mfsdp.FullyShardedOptimizer(model, precision=mfsdp.OptimizerPrecision(), state_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="precision must be a megatron.fsdp.OptimizerPrecision"):
        mfsdp.FullyShardedOptimizer(model, precision=torch.bfloat16)
