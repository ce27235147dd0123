"""The step's expert routing on the driver: the rollout engine's routing in the batch's layout,
what routing replay replays, and the ``moe/`` metrics. Routing tables are
``megatron_bridge.moe.table``'s ``[rows, positions, layers, k]``: the batch's rows and token
positions (prompt then response), every MoE layer, the k experts, -1 where nothing was recorded.
"""

from __future__ import annotations

import torch

from megatron_bridge.moe.table import RoutingRecord, empty_routing, expert_counts, routing_change
from recipe.tracking.metrics import moe_load_metrics


def rollout_routing(routed_experts: list[torch.Tensor] | None, width: int) -> torch.Tensor | None:
    """The engine's per-response routing ([tokens, layers, k], from the first prompt token) in the
    batch's layout: [rows, width, layers, k], -1 past what the engine reported."""
    if routed_experts is None:
        return None
    layers, topk = routed_experts[0].shape[1:]
    out = empty_routing(len(routed_experts), width, layers, topk)
    for row, experts in enumerate(routed_experts):
        out[row, : len(experts)] = experts[:width]
    return out


def replay_source(rollout: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """R3's experts for the training forwards: the rollout's where it reported them, else what the
    old-log-prob pass used there (its own choice, at positions whose routing the loss never reads)."""
    return torch.where((rollout >= 0).all(-1, keepdim=True), rollout, old)


def routing_metrics(old: RoutingRecord, valid: torch.Tensor, num_experts: int, rollout: torch.Tensor | None,
                    drift: tuple[torch.Tensor, torch.Tensor] | None, update: RoutingRecord | None) -> dict[str, float]:
    """The step's ``moe/`` metrics (docs/recipe.md, "Metrics"):

    - load balance (``moe_load_metrics``) and the router's entropy and top-k probability mass, from
      the old-log-prob pass;
    - ``moe/routing_drift/*``: rows routed again after the update vs the old-log-prob pass
      (``drift`` = (rows, their routing now));
    - ``moe/rollout_routing_mismatch/*``: the rollout engine's routing vs the old-log-prob pass's
      own choice (when the engine reports routing);
    - ``moe/replay_override/slot_frac``: in the training forwards under replay (``update``), the
      share of expert slots where the router's own choice differed from the replayed one;
    - ``moe/routing_bytes``: routing kept on the driver this step.
    """
    metrics = moe_load_metrics(expert_counts(old.routing, valid, num_experts)) if old.routing is not None else {}
    seen = old.tokens > 0
    if seen.any():
        metrics["moe/router_entropy/mean"] = float((old.entropy[seen] / old.tokens[seen]).mean())
        metrics["moe/router_topk_mass/mean"] = float((old.topk_mass[seen] / old.tokens[seen]).mean())
    kept = old.nbytes
    if rollout is not None:
        kept += rollout.numel() * rollout.element_size()
        if old.routing is not None:
            metrics.update(routing_change(old.routing, rollout, valid, "moe/rollout_routing_mismatch"))
    if drift is not None and old.routing is not None:
        rows, now = drift
        metrics.update(routing_change(old.routing[rows], now, valid[rows], "moe/routing_drift"))
    if update is not None and update.tokens.sum() > 0 and old.routing is not None:
        slots = update.tokens.sum() * old.routing.shape[-1]
        metrics["moe/replay_override/slot_frac"] = float(update.overridden_slots.sum() / slots)
    metrics["moe/routing_bytes"] = float(kept)
    return metrics
