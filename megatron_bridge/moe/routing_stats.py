"""Tokens per expert in each MoE layer, counted from megatron's routers during a forward pass.

The trainer turns the counts into ``moe/`` load-balance metrics. Only valid tokens count: the
actor pads every micro-batch to one length, and padding would otherwise pile onto whatever expert
the pad token routes to. With context parallelism the mask is not split the way the tokens
are, so padding is counted there too.
"""

from __future__ import annotations

import torch

from megatron_bridge.runtime.actor import response_ends


def valid_token_mask(micro_batch: dict[str, torch.Tensor], seq_len: int) -> torch.Tensor:
    """[s * b] bool, sequence-major like the router's input: positions before each row's response end."""
    ends = response_ends(micro_batch)
    positions = torch.arange(seq_len, device=ends.device)
    return (positions[:, None] < ends[None, :]).reshape(-1)


class RoutingCounter:
    """Forward hooks on every ``TopKRouter`` of ``chunks``; ``counts`` maps the global layer
    number (1-based) to a [num_experts] tensor of routed (token, expert) pairs."""

    def __init__(self, chunks: list[torch.nn.Module], sequence_parallel: bool):
        from megatron.core.transformer.moe.router import TopKRouter

        self.sequence_parallel = sequence_parallel
        self.enabled = True  # off while training: only the old-log-prob pass is counted
        self.counts: dict[int, torch.Tensor] = {}
        self._mask: torch.Tensor | None = None
        self._handles = [
            module.register_forward_hook(self._hook)
            for chunk in chunks
            for module in chunk.modules()
            if isinstance(module, TopKRouter)
        ]

    def set_micro_batch(self, micro_batch: dict[str, torch.Tensor], seq_len: int) -> None:
        mask = valid_token_mask(micro_batch, seq_len)
        if self.sequence_parallel:
            # with SP each TP rank routes its slice of the sequence-major tokens
            from megatron.core import parallel_state as ps

            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            mask = mask.chunk(tp)[rank]
        self._mask = mask

    def _hook(self, module, inputs, output) -> None:
        if not self.enabled:
            return
        routing_map = output[1].detach()
        if self._mask is not None and self._mask.numel() == routing_map.shape[0]:  # not with CP
            routing_map = routing_map[self._mask.to(routing_map.device)]
        counts = routing_map.sum(dim=0).to(torch.long).cpu()
        layer = int(module.layer_number)
        self.counts[layer] = self.counts.get(layer, 0) + counts

    def pop(self) -> dict[int, torch.Tensor]:
        counts, self.counts = self.counts, {}
        return counts

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
