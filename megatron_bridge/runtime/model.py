"""Build a megatron-core GPTModel with Qwen3-MoE semantics from a ModelSpec and a training layout.

Call ``megatron_bridge.runtime.platform.activate()`` and ``parallel_state.initialize_model_parallel()``
first. Qwen3-MoE in Megatron terms: GQA with qk-layernorm (RMSNorm over head_dim), RMSNorm,
SwiGLU experts without bias, softmax top-k router whose top-k weights are renormalised
(``moe_router_pre_softmax=False`` computes the softmax over the k selected logits, which is what
HF's ``norm_topk_prob=True`` does), rope, untied embeddings.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_bridge.plan.layout import TrainParallel
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.runtime.kernels import KernelChoice, resolve


@dataclass(frozen=True)
class BuildOptions:
    params_dtype: torch.dtype = torch.bfloat16
    fp32_router: bool = True  # megatron warns for >= 32 experts without it
    dispatcher: str | None = None  # None: alltoall where it works, allgather on CPU
    aux_loss: bool = False  # RL default: no load-balancing loss


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """RMSNorm usable with sequence parallel: its weight carries ``sequence_parallel`` so megatron
    all-reduces its gradient over TP (megatron's torch-norm wrapper refuses SP because a plain norm
    does not)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def transformer_config(spec: ModelSpec, train: TrainParallel, options: BuildOptions, platform_name: str,
                       kernels: KernelChoice):
    from megatron.core.transformer import TransformerConfig

    dispatcher = options.dispatcher or ("allgather" if platform_name == "cpu" else "alltoall")
    recompute = train.recompute_granularity
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if options.aux_loss else "none",
        moe_aux_loss_coeff=spec.router_aux_loss_coef if options.aux_loss else 0.0,
        moe_router_dtype="fp32" if options.fp32_router else None,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=train.grouped_gemm,
        moe_permute_fusion=kernels.permute_fusion,
        tensor_model_parallel_size=train.tp,
        pipeline_model_parallel_size=train.pp,
        virtual_pipeline_model_parallel_size=train.vpp,
        expert_model_parallel_size=train.ep,
        expert_tensor_parallel_size=train.etp,
        context_parallel_size=train.cp,
        sequence_parallel=train.sequence_parallel,
        num_layers_in_first_pipeline_stage=train.first_stage_layers,
        num_layers_in_last_pipeline_stage=train.last_stage_layers,
        account_for_embedding_in_pipeline_split=train.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=train.account_for_loss_in_pipeline_split,
        recompute_granularity=recompute,
        recompute_method=train.recompute_method if recompute == "full" else None,
        recompute_num_layers=train.recompute_num_layers if recompute == "full" else None,
        params_dtype=options.params_dtype,
        pipeline_dtype=options.params_dtype,
        # As Megatron-LM's training sets them with VPP: batched p2p of the interleaved schedule posts a
        # send and a receive in both directions between the same two ranks when PP = 2, which cross
        # (megatron/training/arguments.py requires PP > 2 without the overlap).
        overlap_p2p_comm=train.vpp is not None,
        batch_p2p_comm=train.vpp is None,
        bf16=options.params_dtype == torch.bfloat16,
        variable_seq_lengths=dispatcher not in ("allgather", "alltoall_seq"),
        use_cpu_initialization=platform_name == "cpu",
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        # SwiGLU through megatron's bias_swiglu / weighted_bias_swiglu, which MindSpeed points at npu_swiglu
        bias_activation_fusion=platform_name == "npu",
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def layer_spec(config, train: TrainParallel, kernels: KernelChoice):
    """Transformer Engine's spec when TE is importable (MindSpeed provides it on NPU), else
    megatron's local spec with a sequence-parallel-capable RMSNorm; attention and experts as
    ``megatron_bridge.runtime.kernels`` resolves the layout's switches."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    if kernels.transformer_engine:
        block = copy.deepcopy(get_gpt_decoder_block_spec(config, use_transformer_engine=True))
        if not train.flash_attn:
            for spec in block.layer_specs:
                spec.submodules.self_attention.submodules.core_attention = DotProductAttention
        return block
    from megatron_bridge.runtime.attention import SDPAttention
    from megatron_bridge.runtime.experts import GroupedExperts

    # megatron's local spec with moe_grouped_gemm would take its legacy GroupedMLP (which needs the
    # grouped_gemm package): build the sequential one and put this package's experts in its place
    sequential = copy.copy(config)
    sequential.moe_grouped_gemm = False
    block = copy.deepcopy(get_gpt_decoder_block_spec(sequential, use_transformer_engine=False, normalization="RMSNorm"))
    for spec in block.layer_specs:
        layer = spec.submodules
        layer.input_layernorm = SequenceParallelRMSNorm
        layer.pre_mlp_layernorm = SequenceParallelRMSNorm
        attention = layer.self_attention.submodules
        attention.q_layernorm = SequenceParallelRMSNorm
        attention.k_layernorm = SequenceParallelRMSNorm
        attention.core_attention = SDPAttention if train.flash_attn else DotProductAttention
        if train.grouped_gemm:
            layer.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    block.layer_norm = SequenceParallelRMSNorm
    return block


def build_model_chunks(spec: ModelSpec, train: TrainParallel, options: BuildOptions, platform_name: str):
    """The model chunks this rank owns (one per virtual pipeline stage)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    kernels = resolve(train, platform_name)
    config = transformer_config(spec, train, options, platform_name, kernels)
    chunks = []
    for vp_rank in range(train.vpp or 1):
        if train.vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp_rank)
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False)
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(config, train, kernels),
                vocab_size=spec.vocab_size,
                max_sequence_length=spec.max_position_embeddings,
                pre_process=pre,
                post_process=post,
                share_embeddings_and_output_weights=spec.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_base=int(spec.rope_theta),
                parallel_output=True,
            )
        )
    if train.vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return config, chunks
