"""Which compute paths the actor runs on this device: the layout's switches (verl's
``override_transformer_config`` keys ``use_flash_attn``, ``moe_grouped_gemm``, ``moe_permute_fusion``,
held in ``TrainParallel``) resolved against what is installed.

- Transformer Engine present (on the NPU MindSpeed provides it): TE's layer spec, TE's attention
  and grouped experts (``TEGroupedMLP``); on the NPU MindSpeed swaps in its own kernels
  (``npu_fusion_attention``, ``npu_gmm``) when its features are switched on
  (``megatron_bridge.runtime.mindspeed``).
- Otherwise megatron's local spec with this package's modules: attention on torch's SDPA
  (``megatron_bridge.runtime.attention``), experts as grouped GEMMs
  (``megatron_bridge.runtime.experts``).
- ``use_flash_attn=false`` keeps megatron's ``DotProductAttention`` and ``moe_grouped_gemm=false``
  its ``SequentialMLP``, for comparisons.
- Token permutation is fused only where a kernel exists (TE >= 2.1, MindSpeed); elsewhere the
  switch is reported as not applied.
- The optimizer step: TE's or Apex's fused Adam where megatron finds one (MindSpeed's on the NPU),
  otherwise torch's AdamW on its fused kernel (``megatron_compat.fuse_torch_adam``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from megatron_bridge.plan.layout import TrainParallel


@dataclass(frozen=True)
class KernelChoice:
    transformer_engine: bool  # TE's layer spec (MindSpeed's stand-in on the NPU)
    attention: str  # what computes the attention, in words
    experts: str  # what computes the local experts, in words
    permute_fusion: bool  # megatron's moe_permute_fusion
    not_applied: tuple[str, ...] = ()  # switches asked for that this device cannot honour, with the reason

    def describe(self) -> str:
        parts = [f"attention: {self.attention}", f"experts: {self.experts}",
                 f"token permutation: {'fused' if self.permute_fusion else 'unfused'}"]
        return "; ".join(parts + [f"not applied: {n}" for n in self.not_applied])


def optimizer_path(optimizers: list) -> str:
    """What steps the actor's optimizer, in words: the class of megatron's inner optimizers, and
    whether torch's runs on its fused kernel."""
    if not optimizers:
        return "none"
    kinds = {f"{type(o).__module__.split('.')[0]} {type(o).__name__}" for o in optimizers}
    name = ", ".join(sorted(kinds))
    if all(type(o).__module__.startswith("torch.optim") for o in optimizers):
        fused = all(g.get("fused") for o in optimizers for g in o.param_groups)
        name += " (fused kernel)" if fused else " (not fused)"
    return name


def transformer_engine_version() -> str | None:
    """The importable Transformer Engine's version (MindSpeed's stand-in reports one too), else None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        from megatron.core.utils import get_te_version

        return str(get_te_version())
    except (ImportError, AttributeError, RuntimeError):
        return None


def resolve(train: TrainParallel, platform_name: str) -> KernelChoice:
    """The paths ``train``'s switches give on ``platform_name`` (call after the platform is active)."""
    if platform_name == "npu":
        return KernelChoice(
            transformer_engine=True,
            attention="MindSpeed flash attention (npu_fusion_attention)" if train.flash_attn
            else "megatron DotProductAttention (MindSpeed's mask feature off)",
            experts="TEGroupedMLP on MindSpeed's grouped linear (npu_grouped_matmul)" if train.grouped_gemm
            else "megatron SequentialMLP",
            permute_fusion=train.permute_fusion,
        )
    te = transformer_engine_version() if platform_name != "cpu" else None
    not_applied = []
    permute_fusion = train.permute_fusion
    if permute_fusion and not (te and _version_at_least(te, (2, 1))):
        permute_fusion = False
        not_applied.append("moe_permute_fusion (needs Transformer Engine >= 2.1)")
    if te:
        attention = "Transformer Engine" if train.flash_attn else "megatron DotProductAttention"
        experts = "Transformer Engine grouped GEMM (TEGroupedMLP)" if train.grouped_gemm else "megatron SequentialMLP"
    else:
        from megatron_bridge.runtime.experts import grouped_mm_path

        attention = "torch SDPA" if train.flash_attn else "megatron DotProductAttention"
        experts = f"grouped GEMM ({grouped_mm_path()})" if train.grouped_gemm else "megatron SequentialMLP"
    return KernelChoice(te is not None, attention, experts, permute_fusion, tuple(not_applied))


def _version_at_least(version: str, minimum: tuple[int, ...]) -> bool:
    numbers = []
    for part in version.split(".")[: len(minimum)]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers) >= minimum
