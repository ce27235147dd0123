"""Micro-batches cut by tokens (dynamic batch size, verl's ``use_dynamic_bsz``): how many sequences
one holds, for the memory plan and the step-time model alike."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge.plan.layout import Layout, TrainParallel


def replicas(layout: Layout) -> int:
    """The training DP size sequences are dealt over (world / (TP*PP*CP)); at least 1, as where a
    layout breaks a rule there may be none."""
    t = layout.train
    return max(1, layout.cluster.world_size // (t.tp * t.pp * t.cp))


def least_budget(t: TrainParallel, seq_len: int) -> int:
    """The smallest token budget per device that holds a sequence of ``seq_len`` tokens, padded as the
    layout splits it: each CP rank holds a 1/CP slice of every sequence."""
    padded = -(-seq_len // t.seq_multiple) * t.seq_multiple
    return -(-padded // t.cp)


@dataclass(frozen=True)
class TokenBudget:
    """Each training micro-batch holds at most ``tokens`` per device (verl's
    ``ppo_max_token_len_per_gpu``), so CP x ``tokens`` of whole sequences; and never more rows than a
    DP rank trains on in one optimizer step (``step_rows`` sequences over the layout's DP)."""

    tokens: int
    step_rows: float

    def rows(self, layout: Layout, seq_len: int) -> float:
        """Sequences of ``seq_len`` tokens in one micro-batch, in fractions (the plan's rows are a
        size, not a count: a budget of 1.5 sequences holds 1.5 sequences' tokens of shorter ones)."""
        return min(self.tokens * layout.train.cp / seq_len, self.step_rows / replicas(layout))

    def holds(self, t: TrainParallel, seq_len: int) -> bool:
        return self.tokens >= least_budget(t, seq_len)


def rows_of(micro_batch: float | TokenBudget, layout: Layout, seq_len: int) -> float:
    """Sequences of ``seq_len`` tokens in a micro-batch given as a number of rows or as a token budget."""
    return micro_batch.rows(layout, seq_len) if isinstance(micro_batch, TokenBudget) else micro_batch
