"""MindSpeed's features for this package's actor on the NPU, switched the way MindSpeed expects when
megatron-core is used as a library (MindSpeed branch ``2.2.0_core_r0.12.1``; docs/kernels.md).

``import mindspeed.megatron_adaptor`` patches megatron with the features its argument namespace asks
for, and that namespace is an argparse ``parse_known_args()`` of ``sys.argv`` taken at import
(``mindspeed/args_utils.py``, ``get_mindspeed_args``). Nothing in it asks for flash attention, so on
its own MindSpeed leaves megatron's ``DotProductAttention`` unfused and wraps it with its mask feature,
which then builds a dense [mbs, 1, s, s] mask or raises "Please set micro_batch_size or set
use_flash_attn=True". ``mindspeed.megatron_adaptor.repatch(args: dict)`` (MindSpeed >= 2.2.0, PR !2650,
made for verl) removes every patch, sets the keys on that namespace and applies the patches again;
verl calls it with its ``override_transformer_config`` before it builds the model. So does ``apply``:

- ``feature_args(train, ...)``: the layout's switches (``use_flash_attn``, ``moe_grouped_gemm``,
  ``moe_permute_fusion``: verl's names) as MindSpeed's argument dict; pure, runs anywhere.
- ``apply(train, ...)``: ``repatch`` with it. Call it after ``platform.activate('npu')`` and before
  ``initialize_model_parallel`` and before any ``TransformerConfig`` is built: MindSpeed's
  ``TransformerConfig.__init__`` wrapper copies its namespace into each config when the config is
  built, and with CP > 1 it wraps ``initialize_model_parallel``.
- ``import_adaptor()``: the first import of ``mindspeed.megatron_adaptor`` with ``sys.argv`` reduced to
  the program name, so that the launching command line (Ray's worker flags, a CLI's own flags) is not
  parsed into MindSpeed's features and copied onto every ``TransformerConfig``.

Every name below was read in the MindSpeed tree at branch 2.2.0_core_r0.12.1 (commit a654440c,
2026-01-04; tag v2.2.0_core_r0.12.1 is f321067c and reads the same for these names):

parser options (``MindSpeedFeaturesManager.register_features_args``; defaults in brackets)
  use_fused_rmsnorm [False], use_fused_swiglu [False]   features_manager/megatron_basic/megatron_basic.py
  use_fused_rotary_pos_emb [False]                      features_manager/fusions/fused_rope.py
  use_fused_moe_token_permute_and_unpermute [False]     features_manager/fusions/fused_moe_permute.py
  optimization_level [2]                                features_manager/megatron_basic/requirements_basic.py
  pre_tockens [65536], next_tockens [0], sparse_mode [0] features_manager/transformer/flash_attention/
                                                        fusion_attention_v1_feature.py
  context_parallel_algo [megatron_cp_algo]; choices megatron_cp_algo, hybrid_cp_algo,
    hybrid_adaptive_cp_algo                             features_manager/context_parallel/context_parallel_feature.py
    + ulysses_cp_algo                                   features_manager/context_parallel/ulysses_context_parallel.py
    + adaptive_cp_algo                                  features_manager/context_parallel/adaptive_context_parallel.py
  ulysses_degree_in_cp [None]                           features_manager/context_parallel/ulysses_context_parallel.py
  (not written here, left at their defaults: cp_window_size [1], attention_mask_type [causal],
  use_cp_send_recv_overlap, use_fused_ring_attention_update, megatron_cp_in_bnsd [False]:
  context_parallel_feature.py; context_parallel_kv_cache_policy [None]: context_parallel_kv_cache.py)
feature names that are no parser option (read with ``getattr(args, name, None)``; set only by
``repatch`` or by a matching flag on the command line)
  use_flash_attn          FusionAttentionFeature, fusion_attention_v1_feature.py: patches
                          DotProductAttention.forward with npu_fusion_attention (CP < 2)
  no_create_attention_mask_in_dataloader
                          GenerateMaskFeature, generate_mask_feature.py: on unless this is true; wraps
                          DotProductAttention.forward (core/transformer/flash_attention/generate_mask/)
  moe_grouped_gemm        MoEGmmFeature, features_manager/moe/gmm.py
  moe_permute_fusion      FusedMoEPermuteFeature, fused_moe_permute.py
  context_parallel_size   ContextParallelFeature, features_manager/context_parallel/context_parallel_feature.py
  position_embedding_type AlibiFeature (applies for 'alibi' only); read by FusedRoPEFeature.validate_args
  reset_attention_mask    ResetAttentionMaskFeature (never set here: it replaces GPTModel.forward's
                          packed_seq_params with MindSpeed's own data loader's)

Context parallelism (``context_parallel_size`` > 1): ContextParallelFeature.register_patches puts
``MindSpeedCPDotProductAttention`` (core/context_parallel/adaptor.py, dot_product_attention.py) in
place of megatron's attention, wraps ``initialize_model_parallel`` (the hybrid algorithm's Ulysses
and ring groups: core/context_parallel/model_parallel_utils.py) and megatron's
``get_pos_emb_on_this_cp_rank`` (core/context_parallel/rotary_pos_embedding_utils.py, the rotary
positions of each rank's tokens). Splitting the batch is the caller's: MindSpeed's own
``get_batch_on_this_cp_rank`` (core/context_parallel/get_batch_utils.py) replaces only
``megatron.training``'s. What each algorithm expects a CP rank to hold of a sequence of length s
(causal mask, ``attention_mask_type`` causal), as that function and the RoPE one cut it:

  megatron_cp_algo  megatron's load-balanced split: s as 2*CP chunks, rank r holds chunks r and
                    2CP-1-r, in that order (the ring attention views its tokens as [2, s/(2CP)])
  ulysses_cp_algo   one contiguous slice: tokens [r*s/CP, (r+1)*s/CP)
  hybrid_cp_algo    with U = ulysses_degree_in_cp and R = CP/U, ring rank r_r = r // U and Ulysses
                    rank r_u = r % U: s as 2R chunks, chunks r_r and 2R-1-r_r concatenated, then
                    part r_u of U contiguous parts of those s/R tokens
  adaptive_cp_algo, hybrid_adaptive_cp_algo: an order computed from the attention mask
                    (remapped_seq_order), refused by the planner

MindSpeed checks the algorithms' needs in the features' ``validate_args``, which ``repatch`` does
not run: the planner's rules check them (megatron_bridge/plan/validate.py).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Iterator

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import TrainParallel

ADAPTOR = "mindspeed.megatron_adaptor"
REPATCH_SINCE = "2.2.0"  # MindSpeed PR !2650 (2025-07-18); absent from 2.1.0_core_r0.12.1
BRANCH = "2.2.0_core_r0.12.1"

# The names this module writes, each a name MindSpeed 2.2.0_core_r0.12.1 reads (see the docstring).
PARSER_OPTIONS = frozenset({
    "use_fused_rmsnorm", "use_fused_swiglu", "use_fused_rotary_pos_emb",
    "use_fused_moe_token_permute_and_unpermute", "context_parallel_algo", "ulysses_degree_in_cp",
})
FEATURE_NAMES = frozenset({
    "use_flash_attn", "no_create_attention_mask_in_dataloader", "moe_grouped_gemm", "moe_permute_fusion",
    "context_parallel_size", "position_embedding_type",
})
# torch_npu kernels behind moe_permute_fusion (fused_moe_permute.py: "upgrade CANN to 8.3.RC1 and higher,
# and PTA to 7.2.RC1 and higher"; without them MindSpeed turns the switch off on the TransformerConfig)
PERMUTE_KERNELS = ("npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute_with_routing_map")

_applied: dict[str, Any] | None = None  # what apply() last handed to repatch in this process


def feature_args(train: TrainParallel, packed: bool = False, *, dispatcher: str = "alltoall",
                 fused_elementwise: bool = True) -> dict[str, Any]:
    """MindSpeed's arguments for ``train``'s switches (``flash_attn``, ``grouped_gemm``,
    ``permute_fusion``, ``cp``, ``cp_algo``, ``ulysses_degree_in_cp``), micro-batches packed (``thd``)
    or padded, the MoE ``dispatcher`` and the fused RMSNorm / RoPE / SwiGLU kernels
    (``fused_elementwise``, MindSpeed-RL's Qwen3-MoE set).

    Every key is always present: ``repatch`` only sets the keys it is given, so a second call in the
    same process must say false to what an earlier one switched on."""
    if packed and not train.flash_attn:
        raise ConfigError(
            "packed micro-batches need use_flash_attn=true on the NPU: megatron's DotProductAttention "
            "cannot keep packed sequences apart (MindSpeed's flash attention takes them as TND with "
            "actual_seq_qlen from cu_seqlens)")
    if train.permute_fusion and dispatcher == "allgather":
        raise ConfigError(
            "moe_permute_fusion=true needs the alltoall MoE token dispatcher; MindSpeed refuses it with "
            "allgather (features_manager/fusions/fused_moe_permute.py): set moe_permute_fusion=false")
    if train.cp > 1 and not train.flash_attn:
        raise ConfigError(
            f"context_parallel_size={train.cp} runs MindSpeed's context-parallel attention ({train.cp_algo}), "
            "which is flash attention (MindSpeed switches use_flash_attn on for it): set use_flash_attn=true")
    if train.cp > 1 and packed:
        raise ConfigError(
            f"context_parallel_size={train.cp} with packed micro-batches has not run on an NPU: MindSpeed's ring "
            "attention splits packed (TND) sequences by PackedSeqParams.cu_seqlens_q_padded, which the actor sets, "
            "but its Ulysses and hybrid algorithms and the whole path are untested here; set "
            "actor_rollout_ref.model.use_remove_padding=false")
    return {
        # verl's override_transformer_config names
        "use_flash_attn": train.flash_attn,
        "moe_grouped_gemm": train.grouped_gemm,
        "moe_permute_fusion": train.permute_fusion,
        # MindSpeed's alias of moe_permute_fusion; MindSpeed copies one onto the other on the config
        "use_fused_moe_token_permute_and_unpermute": False,
        # With flash attention the mask feature must stay: it sets sparse_mode=2 (causal) and passes the
        # compressed 2048x2048 mask; without it npu_fusion_attention would attend to every token. Without
        # flash attention it must go: it builds one dense [micro_batch_size, 1, seq_length, seq_length]
        # mask (both fixed, or it raises) and keeps it for every later shape, while megatron's own
        # softmax makes the causal mask of each micro-batch's length.
        "no_create_attention_mask_in_dataloader": not train.flash_attn,
        # npu_rms_norm; MindSpeed's PTNorm (TE spec's TENorm) sets it true on the config anyway
        # (core/megatron_basic/megatron_basic.py), so false here does not unfuse it in 2.2.0
        "use_fused_rmsnorm": fused_elementwise,
        # MindSpeed's JIT-built npu_rotary_position_embedding, read from the global args at each call
        # (core/fusions/fused_rope.py, apply_rotary_pos_emb_bshd)
        "use_fused_rotary_pos_emb": fused_elementwise,
        # inert in 2.2.0 used as a library (only the legacy mindspeed/arguments.py reads it); the fused
        # SwiGLU comes from TransformerConfig.bias_activation_fusion (docs/kernels.md)
        "use_fused_swiglu": fused_elementwise,
        # FusedRoPEFeature.validate_args reads it off every TransformerConfig when fused RoPE is on
        "position_embedding_type": "rope",
        # verl's MindspeedEngineWithLMHead passes it when CP > 1; every feature reads 1 as unset
        "context_parallel_size": train.cp,
        # how the CP ranks attend (and so how the actor splits each sequence: the module's docstring);
        # read from every TransformerConfig (MindSpeed copies its arguments onto it) and, for the
        # hybrid algorithm's groups, by initialize_model_parallel's wrapper
        "context_parallel_algo": train.cp_algo,
        "ulysses_degree_in_cp": train.ulysses_degree_in_cp,
    }


@contextlib.contextmanager
def plain_argv() -> Iterator[None]:
    """``sys.argv`` reduced to the program name while MindSpeed reads it."""
    saved = sys.argv
    sys.argv = saved[:1] or [""]
    try:
        yield
    finally:
        sys.argv = saved


def import_adaptor():
    """``mindspeed.megatron_adaptor``, imported (the first time) under ``plain_argv``: MindSpeed parses
    the command line at import into its features, and everything it does not know onto every
    ``TransformerConfig`` (e.g. a Ray worker's ``--redis-password``); ``-h`` or a bad value for one of
    its options ends the process."""
    if ADAPTOR in sys.modules:
        return sys.modules[ADAPTOR]
    with plain_argv():
        try:
            return importlib.import_module(ADAPTOR)
        except ImportError as e:
            raise ConfigError(
                f"platform npu: cannot import {ADAPTOR} ({e}); install MindSpeed from branch {BRANCH} "
                "(see README, 'Install on Ascend')") from e


def permute_fusion_available() -> bool:
    """Whether torch_npu has the fused token permutation MindSpeed's ``moe_permute_fusion`` calls."""
    try:
        import torch_npu
    except ImportError:
        return False
    return all(hasattr(torch_npu, name) for name in PERMUTE_KERNELS)


def apply(train: TrainParallel, packed: bool = False, *, dispatcher: str = "alltoall",
          fused_elementwise: bool = True) -> dict[str, Any]:
    """Switch MindSpeed's features for ``train`` with ``mindspeed.megatron_adaptor.repatch``; returns
    the arguments. Call after ``platform.activate('npu')``, before ``initialize_model_parallel`` and
    before the model's ``TransformerConfig`` is built."""
    global _applied
    args = feature_args(train, packed, dispatcher=dispatcher, fused_elementwise=fused_elementwise)
    if _applied == args:
        return dict(args)
    adaptor = import_adaptor()
    repatch = getattr(adaptor, "repatch", None)
    if repatch is None:
        raise ConfigError(
            f"the installed MindSpeed has no {ADAPTOR}.repatch, which switches its features on when "
            f"megatron-core is used as a library: it exists from MindSpeed {REPATCH_SINCE} (branch {BRANCH}); "
            "2.1.0 lacks it. pip shows the megatron-core version (0.12.1) for both: install from that branch")
    if train.permute_fusion and not permute_fusion_available():
        raise ConfigError(
            "moe_permute_fusion=true needs torch_npu." + " and torch_npu.".join(PERMUTE_KERNELS)
            + " (CANN >= 8.3.RC1, torch_npu from PTA >= 7.2.RC1); this torch_npu lacks them: upgrade, "
            "or set moe_permute_fusion=false")
    if train.cp > 1:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            raise ConfigError(
                f"context_parallel_size={train.cp}: MindSpeed's features must be applied before "
                "initialize_model_parallel (its context parallelism wraps it)")
    had_te = "transformer_engine" in sys.modules
    repatch(dict(args))
    if not had_te:
        # repatch's pre-patches recreate MindSpeed's stand-in transformer_engine module; MindSpeed's own
        # import takes it out of sys.modules afterwards ("accelerate package will check TE on
        # sys.modules"), and so does this
        sys.modules.pop("transformer_engine", None)
    _applied = dict(args)
    return dict(args)


def check_applied(train: TrainParallel, packed: bool = False, *, dispatcher: str = "alltoall",
                  fused_elementwise: bool = True) -> None:
    """Raise unless ``apply`` was called in this process with these switches: a model built without
    it runs MindSpeed's import-time defaults (no flash attention, a dense mask)."""
    wanted = feature_args(train, packed, dispatcher=dispatcher, fused_elementwise=fused_elementwise)
    if _applied is None:
        raise ConfigError("MindSpeed's features were not switched on before the model was built: call "
                          "megatron_bridge.runtime.mindspeed.apply(train) before initialize_model_parallel")
    differ = sorted(k for k in wanted.keys() | _applied.keys() if wanted.get(k) != _applied.get(k))
    if differ:
        raise ConfigError(
            "MindSpeed's features were applied for other switches than this model's: "
            + ", ".join(f"{k}={_applied.get(k)!r} (wanted {wanted.get(k)!r})" for k in differ))
