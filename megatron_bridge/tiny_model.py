"""The tiny Qwen3-MoE of ``configs/model/tiny_qwen3_moe.yaml`` as a transformers model and HF
checkpoint, for tests, benchmarks and the CPU examples.

Weights are drawn so that every linear map roughly keeps unit variance: with transformers' default
init (std 0.02) log-probs would be near uniform and tokens would spread almost evenly over the
experts, which would make every layout look right and flatter expert-parallel ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_bridge.plan.model_spec import load_hf_config

TINY = "tiny_qwen3_moe"


def tiny_hf_model(seed: int = 0, config: str = TINY, **overrides):
    """transformers' Qwen3MoeForCausalLM with a tiny config (``configs/model/<config>.yaml``, plus
    ``overrides``), fp32, eval."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**load_hf_config(config), **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                # unit-variance outputs for linear maps; the embedding gets unit entries
                fan_in = param.shape[-1] if param.dim() > 1 and "embed_tokens" not in name else 1
                param.copy_(torch.randn_like(param) / fan_in**0.5)
    return model


def save_tiny_checkpoint(directory: str | Path, seed: int = 0, **overrides) -> str:
    """Save the tiny model as on the Hub (per-expert tensor names, safetensors)."""
    tiny_hf_model(seed, **overrides).save_pretrained(directory)
    return str(directory)
