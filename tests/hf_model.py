"""A tiny Qwen3-MoE saved with transformers, with weights scaled so that log-probs and routing are
far from uniform (transformers' default init, std 0.02, would make every layout look right)."""

from __future__ import annotations

import torch

from megatron_bridge.model_spec import load_hf_config

TINY = "tiny_qwen3_moe"


def hf_model(seed: int = 0, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**load_hf_config(TINY), **overrides})
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


def save_checkpoint(directory, seed: int = 0, **overrides) -> str:
    """Save the tiny model as on the Hub (per-expert tensor names, safetensors)."""
    hf_model(seed, **overrides).save_pretrained(directory)
    return str(directory)


def reference_log_probs(directory, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' log p(input_ids[:, t+1] | input_ids[:, :t+1]) for every t, shape [B, S-1]."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
