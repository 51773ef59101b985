"""A GPT training script in the shape of Megatron-LM's ``pretrain_gpt.py`` (``core_v0.19.0``), for the tests.

Megatron-LM's own script lives only in its repository, so the tests drive ``megatron.training.pretrain`` (from the
megatron-core wheel) the way that script does: ``parse_and_validate_args``, the config container, a model provider
building ``GPTModel`` with the local layer spec, mock data, ``get_batch_on_this_tp_rank``, the same loss function.
Two additions: every micro-batch's loss sum and token count are written to ``$LOSSES_DIR/rank<r>.json``
(tensor-parallel rank 0 of each data-parallel rank), and the grad norm and params norm ``training_log`` is handed
each iteration to ``$LOSSES_DIR/norms.json`` (rank 0; both are global), so a test compares them exactly, not the log
line's rounding. Run it as ``torchrun ... -m megatron.fsdp.mcore.megatron_lm pretrain_gpt.py <flags>``.
"""

import json
import os
from functools import partial

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.utils import get_batch_on_this_tp_rank
from megatron.fsdp.mcore_cpu.layer_spec import cpu_layer_spec
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

LOSSES = []
NORMS = []


def recording_norms(training_log):
    """``training_log`` that first keeps the iteration's exact grad norm and params norm."""
    def log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag, skipped_iter,
            grad_norm, params_norm, *args, **kwargs):
        NORMS.append([iteration, None if grad_norm is None else float(grad_norm),
                      None if params_norm is None else float(params_norm)])
        return training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                            skipped_iter, grad_norm, params_norm, *args, **kwargs)
    return log


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, vp_stage=vp_stage, pg_collection=pg_collection)


def cpu_spec(model_config, vp_stage=None):
    """The layers on CPU for ``--sequence-parallel``: the local spec with norms that take it (``cpu_layer_spec``)."""
    return cpu_layer_spec(model_config.transformer, vp_stage=vp_stage)


def get_batch(data_iterator):
    args = get_args()
    batch = next(data_iterator) if mpu.get_tensor_model_parallel_rank() == 0 else {}
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=True, cp_size=1, tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=1, is_pipeline_first_stage=True, is_pipeline_last_stage=True)
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if mpu.get_tensor_model_parallel_rank() == 0 and torch.is_grad_enabled():
        LOSSES.append([get_args().curr_iteration, float(loss), int(num_tokens)])
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split=args.split,
                              tokenizer=build_tokenizer(args), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=True, path_to_cache=args.data_cache_path)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         lambda: mpu.get_tensor_model_parallel_rank() == 0, config).build()


if __name__ == "__main__":
    datasets_provider.is_distributed = True
    from megatron.training import training

    training.training_log = recording_norms(training.training_log)
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    if args.sequence_parallel:  # the local spec's torch norms refuse it (on a GPU Megatron-LM builds TE's layers)
        container.model.transformer_layer_spec = cpu_spec
    pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    if os.environ.get("LOSSES_DIR") and mpu.get_tensor_model_parallel_rank() == 0:
        path = os.path.join(os.environ["LOSSES_DIR"], f"rank{torch.distributed.get_rank()}.json")
        with open(path, "w") as f:
            json.dump(LOSSES, f)
    if os.environ.get("LOSSES_DIR") and torch.distributed.get_rank() == 0:
        with open(os.path.join(os.environ["LOSSES_DIR"], "norms.json"), "w") as f:
            json.dump(NORMS, f)
