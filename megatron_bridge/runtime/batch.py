"""The batch contract: what the driver, the workers, the Megatron actor, the routing tap and the
loss hook agree a batch is, and the facts derived from it.

A batch is a dict of tensors, one row per sequence: prompt then response, right-padded.

- ``input_ids`` [B, S] long: prompt tokens then response tokens, right-padded;
- ``prompt_lengths`` [B] long;
- ``response_mask`` [B, R]: 1 at the response tokens the loss counts (R: the widest response);
- ``old_log_probs`` [B, R]: the old-log-prob pass (the policy that sampled, as the trainer computes it);
- ``ref_log_probs`` [B, R]: the reference model's, only with KL in the loss or the reward;
- ``advantages`` [B, R];
- ``rollout_is_weights`` [B, R]: rollout correction's IS weights, optional;
- ``routed_experts`` [B, S, layers, k]: experts to replay (``ReplayMode``), -1: keep the router's.

Response token j of row i is ``input_ids[i, prompt_lengths[i] + j]``. The actor passes every key
through to the loss hook (``loss.megatron_hook``, which reads its inputs by these names) and adds
to each micro-batch ``position_ids``, ``row_index`` (the rows' indices in the pass's batch) and
``response_ends``, so that the routing tap reads the ends the actor cut the micro-batch with; it
cuts on the host and adds what would otherwise be read back from the device in the passes:
``response_index`` (the loss's response tokens) and, packed, ``packed_seq_params``. A
packed micro-batch (``use_remove_padding``) holds its rows' tokens up to their response ends back to
back in ``input_ids`` [1, T], with ``sequence_starts`` and ``cu_seqlens``; the per-row keys keep
their [b, ...] shapes. With context parallel every CP rank keeps the whole micro-batch and the model
gets the ``held_positions`` of it (``megatron_bridge.runtime.context_parallel``); packed, each row's
tokens are padded to a multiple of 2 x CP.

It lives here, beside the actor, because ``megatron_bridge`` may not import ``recipe`` while the
recipe may import ``megatron_bridge``; it names the loss hook's inputs but computes nothing of the
RL algorithm.
"""

from __future__ import annotations

from enum import Enum

import torch

INPUT_IDS = "input_ids"
PROMPT_LENGTHS = "prompt_lengths"
RESPONSE_MASK = "response_mask"
OLD_LOG_PROBS = "old_log_probs"
REF_LOG_PROBS = "ref_log_probs"
ADVANTAGES = "advantages"
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
ROUTED_EXPERTS = "routed_experts"
# added by the actor to each micro-batch
POSITION_IDS = "position_ids"
ROW_INDEX = "row_index"
RESPONSE_ENDS = "response_ends"
# ... and to each packed one (its rows back to back in one sequence of the input_ids [1, T])
SEQUENCE_STARTS = "sequence_starts"  # [b]: where each row's tokens begin in the packed sequence
CU_SEQLENS = "cu_seqlens"  # [b + 1 or b + 2] int32: sequence boundaries (a trailing padding segment last)
# ... and, with context parallel, to what the model and the loss hook see of each micro-batch
HELD_POSITIONS = "held_positions"  # [s / CP]: the (packed) sequence positions this CP rank holds
# ... and, computed on the host where reading values is free, what the passes would otherwise read
# back from the device
RESPONSE_INDEX = "response_index"  # [3, N]: the loss's response tokens (loss.megatron_hook.response_token_index)
# megatron's PackedSeqParams of a packed micro-batch (not a tensor; its host_bounds: the boundaries as ints)
PACKED_SEQ_PARAMS = "packed_seq_params"


class ReplayMode(str, Enum):
    """Routing replay (verl's ``megatron.router_replay.mode``): which forwards replay experts."""

    DISABLED = "disabled"
    R2 = "R2"  # the training forwards replay the experts the old-log-prob pass chose
    R3 = "R3"  # the old-log-prob pass and the training forwards replay the rollout engine's

    @property
    def in_old_log_prob_pass(self) -> bool:
        return self is ReplayMode.R3

    @property
    def in_update(self) -> bool:
        return self is not ReplayMode.DISABLED


def make_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + response per row, right-padded with ``pad_id``."""
    width_r = max(1, max(len(r) for r in responses))
    width = max(len(p) for p in prompts) + width_r
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros(len(prompts), width_r, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        response_mask[i, : len(r)] = 1
    return {
        INPUT_IDS: input_ids,
        PROMPT_LENGTHS: torch.tensor([len(p) for p in prompts], dtype=torch.long),
        RESPONSE_MASK: response_mask,
    }


def right_padded(rows: list[list[float]], width: int) -> torch.Tensor:
    """Per-token values of each response ([rows, width] float32, 0 past each row's values)."""
    out = torch.zeros(len(rows), width)
    for row, values in enumerate(rows):
        out[row, : len(values)] = torch.tensor(values, dtype=out.dtype)
    return out


def response_ends(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per row: prompt length + index past the last valid response token."""
    mask = batch[RESPONSE_MASK].bool()
    width = mask.shape[1]
    last = width - torch.flip(mask, dims=[1]).int().argmax(dim=1)
    return batch[PROMPT_LENGTHS] + torch.where(mask.any(dim=1), last, 0)


def packed_places(starts: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``tokens`` (positions on a packed sequence's axis) and the ascending ``starts`` of its
    parts: each token's part and its position within that part."""
    part = torch.searchsorted(starts, tokens, right=True) - 1
    return part, tokens - starts[part]


def token_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[rows, width] bool: the positions the model reads (prompt and response, not the padding)."""
    return torch.arange(batch[INPUT_IDS].shape[1]) < response_ends(batch)[:, None]


def dp_shares(rows: int, mini_batch_rows: int, dp_size: int, lengths: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Row indices of each DP rank: each global mini-batch is dealt out whole, so mini-batch m
    holds the same rows whatever the DP size (DP-invariant update). Rank d takes the d-th slice;
    given the rows' ``lengths`` (dynamic batch size) they go longest first in snake order (0..D-1,
    D-1..0, ...), so every rank gets as many long rows and cuts into similar micro-batches."""
    per_rank = mini_batch_rows // dp_size
    index = torch.arange(rows).reshape(rows // mini_batch_rows, dp_size, per_rank)
    if lengths is not None:
        longest_first = torch.argsort(lengths.reshape(-1, mini_batch_rows), dim=1, descending=True, stable=True)
        backwards = torch.arange(per_rank)[:, None] % 2 == 1  # odd rounds deal backwards
        ranks = torch.where(backwards, torch.arange(dp_size).flip(0), torch.arange(dp_size))  # [round, D]
        slots = (ranks * per_rank + torch.arange(per_rank)[:, None]).reshape(-1)  # deal p -> slot in a mini-batch
        index = torch.empty_like(index).view(-1, mini_batch_rows)
        index[:, slots] = longest_first + torch.arange(0, rows, mini_batch_rows)[:, None]
        index = index.view(rows // mini_batch_rows, dp_size, per_rank)
    return [index[:, d].reshape(-1) for d in range(dp_size)]
