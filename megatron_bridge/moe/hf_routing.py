"""The experts transformers' Qwen3-MoE routes each token to: the reference for the sharded model's
routing (``verify``) and the CPU rollout engine's report of its routing (R3, mismatch metrics).

transformers 5's gate (``Qwen3MoeTopKRouter``) returns ``(logits, weights, indices)``; transformers
4's gate is a linear layer whose logits the block ranks itself, so both are read.
"""

from __future__ import annotations

import re

import torch

from megatron_bridge.moe.table import NONE, ROUTING_DTYPE

_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")


class HFRoutingRecorder:
    """Forward hooks on every MoE gate of a transformers Qwen3-MoE model. After each model call,
    ``take()`` returns its routing: [tokens, layers, k] int16 expert ids, ascending, tokens in the
    order the model flattened them ([batch, seq]); -1 for a dense layer."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.layers, self.topk = config.num_hidden_layers, config.num_experts_per_tok
        self._calls: dict[int, torch.Tensor] = {}
        self._handles = []
        for name, module in model.named_modules():
            match = _GATE.match(name)
            if match:
                self._handles.append(module.register_forward_hook(self._hook(int(match[1]))))
        if not self._handles:
            raise ValueError("no MoE gate (model.layers.N.mlp.gate) found: not a Qwen3-MoE model")

    def _hook(self, layer: int):
        def record(module, inputs, output) -> None:
            if isinstance(output, tuple):  # transformers 5: (logits, weights, indices)
                indices = output[2]
            else:  # transformers 4: the logits
                indices = output.reshape(-1, output.shape[-1]).topk(self.topk, dim=-1).indices
            self._calls[layer] = indices.detach()

        return record

    def take(self, device: str | torch.device = "cpu") -> torch.Tensor:
        """The routing of the last model call, on ``device``, and forget it. A decoding loop on an
        accelerator keeps it there and copies the whole once: a copy per call waits for the device."""
        if not self._calls:
            raise RuntimeError("no routing recorded: call the model first")
        tokens = next(iter(self._calls.values())).shape[0]
        out = torch.full((tokens, self.layers, self.topk), NONE, dtype=ROUTING_DTYPE, device=device)
        for layer, indices in self._calls.items():
            out[:, layer] = indices.sort(dim=-1).values.to(device=device, dtype=ROUTING_DTYPE)
        self._calls = {}
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
