"""The tiny Qwen3-MoE of ``configs/model/tiny_qwen3_moe.yaml`` as a HF checkpoint, for benchmarks.

Weights are drawn so that every linear map roughly keeps unit variance. With transformers' default
init (std 0.02) the router logits would all be near zero and tokens would spread almost evenly over
the experts, which no trained MoE does and which would flatter expert-parallel layouts.
"""

from __future__ import annotations

from pathlib import Path

import torch

MODEL = "tiny_qwen3_moe"


def _draw_(name: str, param: torch.Tensor) -> None:
    """Norm weights near 1, embeddings unit entries, matrices N(0, 1 / fan_in) (in place)."""
    if name.endswith("norm.weight"):
        param.normal_(1.0, 0.2)
    elif param.dim() >= 2 and "embed_tokens" not in name:
        param.normal_(0.0, param.shape[-1] ** -0.5)
    else:
        param.normal_(0.0, 1.0)


def save_tiny_checkpoint(directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to ``directory`` with transformers (safetensors, Hub tensor names)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron_bridge.model_spec import load_hf_config

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**load_hf_config(MODEL))).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            _draw_(name, param)
    model.save_pretrained(directory)
    return Path(directory)
