"""Routing tables: a batch's expert routing in a layout-independent form, put together from the
ranks' records, and what is computed from it (drift between two tables, tokens per expert). Pure torch.

A routing table is an int16 tensor ``[rows, positions, layers, k]``: for each row, token position
and MoE layer (0-based, as in the HF checkpoint's ``model.layers.N``), the ids of the k experts the
router chose, ascending; ``-1`` where nothing was recorded (padding, a position the rollout engine
did not report). Comparing two tables counts, per token and layer, the expert slots that differ:
``k - |A ∩ B|`` (the order of the k experts does not matter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NONE = -1  # "no expert recorded" in a routing tensor
ROUTING_DTYPE = torch.int16  # expert ids up to 32767


def empty_routing(rows: int, positions: int, layers: int, topk: int) -> torch.Tensor:
    return torch.full((rows, positions, layers, topk), NONE, dtype=ROUTING_DTYPE)


def changed_slots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., k] expert sets -> [...] number of experts in ``a`` that are not in ``b``."""
    same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)
    return a.shape[-1] - same.sum(-1)


def routing_change(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor, prefix: str) -> dict[str, float]:
    """How much routing ``b`` differs from ``a`` on the tokens ``valid`` [rows, positions] marks and
    both recorded in every layer:

    - ``{prefix}/slot_frac``: changed expert slots / (tokens x layers x k), over all layers;
    - ``{prefix}/slot_frac/layer_{l}``: the same in layer l (0-based);
    - ``{prefix}/token_any_frac``: tokens whose expert set changed in at least one layer / tokens;
    - ``{prefix}/tokens``: how many tokens were compared.

    Empty when no token qualifies.
    """
    if a.shape != b.shape or a.dim() != 4 or valid.shape != a.shape[:2]:
        raise ValueError(f"expected two routings [rows, positions, layers, k] and valid [rows, positions]; got "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(valid.shape)}")
    both = valid.bool() & (a >= 0).all(-1).all(-1) & (b >= 0).all(-1).all(-1)
    tokens = int(both.sum())
    if tokens == 0:
        return {}
    changed = changed_slots(a[both].long(), b[both].long()).double()  # [tokens, layers]
    topk = a.shape[-1]
    per_layer = changed.sum(0) / (tokens * topk)
    out = {f"{prefix}/slot_frac": float(per_layer.mean()), f"{prefix}/token_any_frac": float((changed > 0).any(-1).double().mean()),
           f"{prefix}/tokens": float(tokens)}
    out.update({f"{prefix}/slot_frac/layer_{layer}": float(v) for layer, v in enumerate(per_layer)})
    return out


def expert_counts(routing: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[layers, experts]: how many valid tokens each layer sent to each expert."""
    chosen = routing[valid.bool() & (routing >= 0).all(-1).all(-1)].long()  # [tokens, layers, k]
    layers = routing.shape[2]
    offsets = torch.arange(layers).view(1, layers, 1) * num_experts
    return torch.bincount((chosen + offsets).reshape(-1), minlength=layers * num_experts).view(layers, num_experts)


@dataclass
class RoutingRecord:
    """The routing one pass recorded, by one rank or put together for the whole batch.

    ``routing``: a routing table over ``layers`` (0-based): [rows, width, len(layers), k]; a rank's
    record has -1 where it routed nothing (other ranks' sequence slices) and covers its pipeline
    stage's layers; None when the pass did not capture. Per layer, summed over the valid tokens
    routed: ``tokens``, ``overridden_slots`` (expert slots where replay replaced the router's own
    choice), ``entropy`` (of the router's softmax over all experts) and ``topk_mass`` (softmax
    probability of the k chosen experts).
    """

    layers: list[int]
    routing: torch.Tensor | None
    tokens: torch.Tensor  # [layers]
    overridden_slots: torch.Tensor
    entropy: torch.Tensor
    topk_mass: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 0 if self.routing is None else self.routing.numel() * self.routing.element_size()


def merge_records(records: list[RoutingRecord], rows_of: list[torch.Tensor], distinct_tokens: list[bool], width: int,
                  layers: int, topk: int) -> RoutingRecord:
    """Put the ranks' ``RoutingRecord``s of one pass together: rank i recorded the rows
    ``rows_of[i]`` of the batch, its pipeline stage's layers and, with sequence parallel, its slice
    of the positions (-1 elsewhere: records of one batch overlap only where they agree).
    ``distinct_tokens[i]``: whether rank i's tokens count in the sums (TP ranks without sequence
    parallel route the same tokens, so only one of them does)."""
    rows = int(max(int(r.max()) for r in rows_of)) + 1
    routing = empty_routing(rows, width, layers, topk) if any(r.routing is not None for r in records) else None
    sums = {name: torch.zeros(layers, dtype=torch.float64) for name in ("tokens", "overridden_slots", "entropy", "topk_mass")}
    for record, rows_i, distinct in zip(records, rows_of, distinct_tokens):
        if routing is not None and record.routing is not None:
            index = (rows_i[:, None], slice(None), torch.tensor(record.layers)[None, :])
            routing[index] = torch.maximum(routing[index], record.routing.permute(0, 2, 1, 3))
        if distinct:
            for name, total in sums.items():
                total[record.layers] += getattr(record, name).double()
    return RoutingRecord(layers=list(range(layers)), routing=routing, **sums)
