"""The checks on the weight stream that the vLLM rollout engine hands to vLLM's model.

The trainer's export yields (Hub name, full tensor) pairs. ``CheckedStream`` checks each against the
tensors and shapes of the Hub checkpoint (``hub_tensor_shapes``, from config.json) before vLLM sees
it; ``local_experts`` / ``missing_local_experts`` find the experts this rank holds that the stream
lacked; ``reattach_moe_weight_loaders`` readies FusedMoE for the next load. Used by
``recipe.rollout.vllm_engine.VLLMEngine.load_weights``; nothing here imports vllm.

API facts relied on (vllm-project/vllm 0.11; sources as noted):

- ``Qwen3MoeForCausalLM.load_weights(iterable)`` takes HF names (per-expert gate/up/down_proj),
  writes each tensor into its parameter as it arrives and returns the set of loaded parameter names;
  experts not local to this EP rank are skipped (FusedMoE weight_loader ``return_success``); an
  unknown name raises (KeyError in Qwen3MoeModel, ValueError in AutoWeightsLoader)
  (vllm/model_executor/models/qwen3_moe.py, models/utils.py).
- FusedMoE's ``w13_weight`` / ``w2_weight`` can lose their ``weight_loader`` attribute once
  ``process_weights_after_loading`` has run; verl re-attaches ``experts.weight_loader`` before every
  sync (verl/utils/vllm/patch.py, patch_vllm_moe_model_weight_loader).
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Mapping, Sequence

import torch

from megatron_bridge.plan.model_spec import spec_from_hf_dict
from megatron_bridge.weights.load import hf_shape, hub_tensor_names
from recipe.rollout.base import WeightLoadError, WeightStream

_PARTIAL = (
    "; vLLM had already written the tensors streamed before it, so the rollout weights are now a mix: "
    "load a complete stream again before generating"
)
_SHOWN = 5  # names listed in an error

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERTS_MODULE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts$")


def hub_tensor_shapes(hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3-MoE Hub checkpoint (per-expert names) with its full shape, from config.json."""
    spec = spec_from_hf_dict(hf_config, name="rollout", source="config.json")
    return {name: hf_shape(spec, name) for name in hub_tensor_names(spec)}


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


class CheckedStream:
    """Passes a weight stream through while checking each (name, tensor) against the Hub shapes
    before vLLM sees it, and counts tensors and bytes. ``current`` is the name last handed on."""

    def __init__(self, weights: WeightStream, expected: Mapping[str, tuple[int, ...]]):
        self._items = iter(weights)
        self.expected = expected
        self.seen: set[str] = set()
        self.tensors = 0
        self.bytes = 0
        self.current: str | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def _fail(self, what: str) -> WeightLoadError:
        return WeightLoadError(what + (_PARTIAL if self.tensors else " (nothing was written)"))

    def __next__(self) -> tuple[str, torch.Tensor]:
        name, tensor = next(self._items)
        if name not in self.expected:
            raise self._fail(f"unexpected tensor {name!r}: not a weight of this model (Hub names expected)")
        if name in self.seen:
            raise self._fail(f"tensor {name!r} appears twice in the stream")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise self._fail(f"tensor {name!r} is not a floating-point torch.Tensor ({type(tensor).__name__})")
        if tuple(tensor.shape) != self.expected[name]:
            raise self._fail(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {self.expected[name]}"
            )
        self.seen.add(name)
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        self.current = name
        return name, tensor

    def missing_dense(self) -> list[str]:
        """Non-expert tensors the stream lacked (every rank receives all of them)."""
        return [n for n in self.expected if n not in self.seen and not _EXPERT.match(n)]


def local_experts(model: torch.nn.Module) -> dict[int, list[int]] | None:
    """layer -> global ids of the experts this rank holds, from each FusedMoE's ``expert_map``
    (global -> local index, -1 elsewhere; None without expert parallel, when the rank holds a
    slice of every expert). Layers whose holding cannot be read are left out, and None is returned
    when no layer can be read (an unknown layout: the check is skipped)."""
    found: dict[int, list[int]] = {}
    for name, module in model.named_modules():
        m = _EXPERTS_MODULE.match(name)
        if m is None:
            continue
        emap = getattr(module, "expert_map", None)
        total, local = getattr(module, "global_num_experts", None), getattr(module, "local_num_experts", None)
        if emap is not None:
            found[int(m[1])] = [g for g, index in enumerate(torch.as_tensor(emap).tolist()) if index >= 0]
        elif total and (local is None or local == total):
            found[int(m[1])] = list(range(int(total)))
    return found or None


def missing_local_experts(experts: Mapping[int, list[int]], seen: set[str]) -> list[str]:
    """Hub names of this rank's experts that the stream lacked."""
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        for layer, ids in sorted(experts.items())
        for e in ids
        for proj in ("gate_proj", "up_proj", "down_proj")
        if f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" not in seen
    ]


def reattach_moe_weight_loaders(model: torch.nn.Module) -> int:
    """Give FusedMoE's w13_weight / w2_weight their module's ``weight_loader`` where
    ``process_weights_after_loading`` replaced the Parameter and dropped it (as verl does). Returns
    how many were re-attached."""
    count = 0
    for module in model.modules():
        loader = getattr(module, "weight_loader", None)
        if not callable(loader):
            continue
        for pname in ("w13_weight", "w2_weight"):
            param = module._parameters.get(pname) if hasattr(module, "_parameters") else None
            if param is not None and not hasattr(param, "weight_loader"):
                param.weight_loader = loader
                count += 1
    return count
