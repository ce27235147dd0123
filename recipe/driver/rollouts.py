"""The driver's central type: one generation's samples, as the rollout ranks made them and the
trainer's step reads them (rewards, advantages, the Megatron passes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipe.data.dataset import PromptSample


@dataclass(kw_only=True)
class Rollout:
    """One generation's samples, in global row order (row = prompt index * n + sample)."""

    samples: list[PromptSample]  # per row
    groups: torch.Tensor  # [N] prompt index within the generation
    response_ids: list[list[int]]
    log_probs: list[list[float]]  # the engine's, per response token
    finish_reasons: list[str]
    routed_experts: list[torch.Tensor] | None = None  # per row, when the engine reports routing
    gen_seconds: float = 0.0  # generation as the slowest rollout rank measured it
    # per row, per response token: the policy version (updates the engines' weights had seen) that made it
    token_versions: list[list[int]] | None = None
    resumed_rows: int = 0  # rows paused by a weight push and continued under the new weights

    @classmethod
    def concat(cls, parts: list[Rollout]) -> Rollout:
        """Generations one after another as one: rows in order, prompt groups numbered on, the
        generation seconds added (each rank generates them one after another)."""
        if len(parts) == 1:
            return parts[0]
        offsets = torch.tensor([0, *(int(p.groups.max()) + 1 for p in parts[:-1])]).cumsum(0)

        def joined(field: str) -> list | None:
            values = [getattr(p, field) for p in parts]
            return None if any(v is None for v in values) else [x for v in values for x in v]

        return cls(samples=joined("samples"), groups=torch.cat([p.groups + o for p, o in zip(parts, offsets)]),
                   response_ids=joined("response_ids"), log_probs=joined("log_probs"),
                   finish_reasons=joined("finish_reasons"), routed_experts=joined("routed_experts"),
                   gen_seconds=sum(p.gen_seconds for p in parts), token_versions=joined("token_versions"),
                   resumed_rows=sum(p.resumed_rows for p in parts))
