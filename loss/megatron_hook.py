"""The Megatron loss hook: vocab-parallel logits in, per-token log-probs and the policy loss out.

Used as the ``loss_func`` that a forward step hands to megatron's ``forward_backward_func``::

    output = model(input_ids, position_ids, attention_mask)           # [b, s, V/tp]
    return output, functools.partial(policy_loss_func, cfg, norm, micro_batch)

A micro-batch is a dict of tensors (the batch contract is ``megatron_bridge.runtime.batch``'s; this
hook reads):

- ``input_ids`` [b, s] long: prompt tokens followed by response tokens, right-padded; or, packed,
  [1, T]: the rows back to back (the model's output is then [1, T, V/tp]);
- ``prompt_lengths`` [b] long;
- ``sequence_starts`` [b] long, optional: row i's first token on the flattened token axis
  (``input_ids`` viewed as [b * s] or [T]); absent means i * s, the padded layout;
- ``held_positions`` [s'] long, only with context parallel: the positions of each sequence (packed:
  of the one sequence) that this CP rank's logits are for, [b, s', V/tp]; ``input_ids`` stay whole.
  Each CP rank scores the tokens whose predecessor it holds and the [b, R] results are summed over
  the CP group, so every CP rank computes every sequence-level quantity and the same loss;
- ``response_mask`` [b, R]: R is the response width, the same for every micro-batch;
- ``old_log_probs``, ``advantages`` [b, R]; ``ref_log_probs`` [b, R] only with the KL loss;
- ``response_index`` [3, N] long, optional: ``response_token_index`` of the micro-batch, computed
  where reading values back is free (the actor: on the host, while it cuts the micro-batch);
- ``rollout_is_weights`` [b, R], optional: rollout-correction IS weights (``loss.rollout_correction``),
  multiplied into the per-token policy loss. Rejection sampling arrives already applied to
  ``response_mask``, so the mini-batch counts the actor takes from it (``MiniBatchNorm``) leave
  rejected tokens out.

With start_i = ``sequence_starts[i]``, response token j of row i is
``input_ids_flat[start_i + prompt_lengths[i] + j]`` and is predicted by
``logits_flat[start_i + prompt_lengths[i] + j - 1]``. Only tokens with ``response_mask`` 1 are
scored; the log-probs and entropies at mask 0 are 0, and their inputs may hold anything.

Importing this module does not import megatron (see ``loss.vocab_parallel``).
"""

from dataclasses import dataclass, field
from typing import ClassVar, Mapping

import torch

from .aggregation import Normalization, agg_loss
from .kl import KL_PENALTY_TYPES, kl_penalty
from .policy import compute_policy_loss
from .registry import PolicyLossSettings, policy_loss_modes
from .rules import Rule, at_least, check_fields, greater_than, one_of
from .vocab_parallel import DEFAULT_CHUNK_SIZE, log_probs_and_entropy, sum_over_context_parallel

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ActorLossConfig:
    """The actor's loss settings, named as verl's actor config, with verl's defaults: the policy
    loss's clip and aggregation settings (``policy``, passed to the loss whole), the KL loss, the
    entropy bonus and the sampling temperature. The recipe's config builds it from its keys.

    ``log_prob_chunk_size``: tokens whose float32 log-softmax is held at once
    (``loss.vocab_parallel.chunk_rows``; 0: all of them, no chunking); ``fused_kernels``: each
    chunk's passes as kernels ``torch.compile`` generates (verl's ``use_fused_kernels``)."""

    loss_mode: str = "vanilla"
    policy: PolicyLossSettings = PolicyLossSettings()
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    temperature: float = 1.0
    log_prob_chunk_size: int = DEFAULT_CHUNK_SIZE
    fused_kernels: bool = False

    # Each field's rule, declared once: checked here, and by the recipe's config under its keys.
    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "loss_mode": one_of(policy_loss_modes),  # asked when checked: a loss may be registered later
        "kl_loss_coef": at_least(0),
        "kl_loss_type": one_of(KL_PENALTY_TYPES),
        "temperature": greater_than(0),  # the logits are divided by it
        "log_prob_chunk_size": at_least(0),  # 0: no chunking
    }

    def __post_init__(self) -> None:
        check_fields(self, self.FIELD_RULES)


@dataclass(frozen=True, kw_only=True)
class MiniBatchNorm(Normalization):
    """How one optimizer step's loss is normalised.

    ``batch_num_tokens`` counts valid response tokens and ``global_batch_size`` rows with at least
    one valid response token, both over the whole global mini-batch (all DP ranks); they and
    ``dp_size`` are the same on every rank. ``num_microbatches`` is the number megatron's schedule
    divides this rank's losses by (its ``num_microbatches`` argument).
    """

    # Required here (the base class's defaults describe one whole batch, not a mini-batch's share).
    dp_size: int = field()
    batch_num_tokens: int = field()
    global_batch_size: int = field()
    num_microbatches: int = field()

    def __post_init__(self) -> None:
        if self.dp_size < 1 or self.num_microbatches < 1:
            raise ValueError(f"dp_size and num_microbatches must be >= 1, got {self.dp_size}, {self.num_microbatches}")
        if self.batch_num_tokens < 0 or self.global_batch_size < 0:
            raise ValueError(
                f"batch_num_tokens and global_batch_size must be >= 0, "
                f"got {self.batch_num_tokens}, {self.global_batch_size}"
            )


def response_token_index(micro_batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[3, N] long: each scored response token's row and column in [b, R] and its position on the
    flattened token axis (``input_ids`` viewed as [b * s] or [T]). Checks that every token lies in
    its sequence after a prompt of at least one token. It finds the tokens (``nonzero``) and checks
    them by reading values, so the actor computes it on the host while it cuts a micro-batch and
    hands it over as ``response_index``: the loss on the device then reads nothing back."""
    input_ids, prompt_lengths = micro_batch["input_ids"], micro_batch["prompt_lengths"]
    mask = micro_batch["response_mask"].bool()
    starts = micro_batch.get("sequence_starts")
    total = input_ids.numel()
    if starts is None:
        starts = torch.arange(len(prompt_lengths), device=input_ids.device) * input_ids.shape[1]
    # A row ends where the next one (in token order) starts.
    order = starts.argsort()
    ends = torch.empty_like(starts)
    ends[order] = torch.cat([starts[order][1:], starts.new_tensor([total])])

    rows, cols = mask.nonzero(as_tuple=True)
    token_pos = starts[rows] + prompt_lengths[rows] + cols
    if bool(((token_pos <= starts[rows]) | (token_pos >= ends[rows])).any()):
        raise ValueError("response tokens must lie inside their sequence, after a prompt of at least one token "
                         "(check prompt_lengths, response_mask and sequence_starts)")
    return torch.stack([rows, cols, token_pos])


def _response_tokens(
    logits: torch.Tensor, micro_batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The logits as rows [b * s' or T', V/tp]; the rows that predict the response tokens this rank
    scores [N] and those tokens [N]; each token's (row, column) in [b, R]. Without context
    parallel s' = s and every response token is scored; with it (``held_positions``) the logits
    cover the s' held positions of each row, and a token is scored where its predecessor is held.
    The tokens are the micro-batch's ``response_index`` where it has one (``response_token_index``)."""
    input_ids, prompt_lengths = micro_batch["input_ids"], micro_batch["prompt_lengths"]
    mask = micro_batch["response_mask"]
    starts = micro_batch.get("sequence_starts")
    held = micro_batch.get("held_positions")
    width = input_ids.shape[1]
    held_shape = input_ids.shape if held is None else (input_ids.shape[0], len(held))
    if (
        input_ids.dim() != 2 or logits.shape[:-1] != held_shape or prompt_lengths.shape != mask.shape[:1]
        or (starts is None and input_ids.shape[0] != len(prompt_lengths))
        or (starts is not None and starts.shape != prompt_lengths.shape)
    ):
        raise ValueError(
            f"expected logits [b, s, V/tp], input_ids [b, s], prompt_lengths [b], response_mask [b, R] (packed: "
            f"logits [1, T, V/tp], input_ids [1, T] and sequence_starts [b]; with held_positions [s'], logits "
            f"[b, s', V/tp]); got logits {tuple(logits.shape)}, input_ids {tuple(input_ids.shape)}, prompt_lengths "
            f"{tuple(prompt_lengths.shape)}, response_mask {tuple(mask.shape)}, sequence_starts "
            f"{None if starts is None else tuple(starts.shape)}, held_positions {None if held is None else tuple(held.shape)}"
        )
    index = micro_batch.get("response_index")
    rows, cols, token_pos = response_token_index(micro_batch) if index is None else index
    targets = input_ids.reshape(-1)[token_pos]  # read from the whole sequence: shifted before any split
    predicting = token_pos - 1
    if held is not None:
        local = torch.full((width,), -1, dtype=torch.long, device=held.device)
        local[held] = torch.arange(len(held), device=held.device)
        local = local[predicting % width]
        mine = local >= 0
        predicting = (predicting // width * len(held) + local)[mine]
        targets, rows, cols = targets[mine], rows[mine], cols[mine]
    return logits.reshape(-1, logits.shape[-1]), predicting, targets, (rows, cols)


def response_log_probs(
    logits: torch.Tensor,
    micro_batch: Mapping[str, torch.Tensor],
    temperature: float,
    with_entropy: bool,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    reuse_logits: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 log-probs [b, R] of the micro-batch's response tokens and, if asked, the entropies
    [b, R] there (0 where ``response_mask`` is 0).

    ``logits`` is the vocab-parallel shard [b, s, V/tp] or, packed, [1, T, V/tp] (megatron GPTModel
    output with ``parallel_output=True``). ``chunk_size``, ``reuse_logits`` and ``fused`` as in
    ``loss.vocab_parallel.vocab_parallel_log_probs_and_entropy``.
    """
    flat, positions, targets, where = _response_tokens(logits, micro_batch)
    # distinct rows of the logits by construction: the unchecked entry, which reads nothing back
    log_probs, entropy = log_probs_and_entropy(flat, positions, targets, temperature, with_entropy, chunk_size,
                                               reuse_logits, fused)
    shape = micro_batch["response_mask"].shape
    log_probs = log_probs.new_zeros(shape).index_put(where, log_probs)
    entropy = None if entropy is None else entropy.new_zeros(shape).index_put(where, entropy)
    if "held_positions" in micro_batch:  # each CP rank scored the tokens it holds: the whole rows on every one
        log_probs = sum_over_context_parallel(log_probs)
        entropy = None if entropy is None else sum_over_context_parallel(entropy)
    return log_probs, entropy


def _token_weighted(value: float, local_tokens: torch.Tensor, norm: MiniBatchNorm) -> torch.Tensor:
    # A mean over this call's tokens, re-weighted so that summing over all calls gives the
    # mean over the mini-batch's tokens.
    return (value * local_tokens / max(norm.batch_num_tokens, 1)).float()


def policy_loss_func(
    cfg: ActorLossConfig, norm: MiniBatchNorm, micro_batch: Mapping[str, torch.Tensor], logits: torch.Tensor
) -> tuple[torch.Tensor, Metrics]:
    """megatron ``loss_func``: the micro-batch's share of the mini-batch loss, and its metrics.

    loss = pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy_loss, each aggregated with
    ``cfg.policy.loss_agg_mode`` over the global mini-batch (``norm``), then multiplied by
    ``norm.num_microbatches`` because megatron divides every micro-batch's loss by it (with
    ``calculate_per_token_loss=False``). With DDP averaging over DP ranks, the step's gradient is
    then the gradient of the whole-mini-batch loss, however the mini-batch is split.

    Metrics are detached float32 scalars whose sum over all micro-batches and DP ranks is the
    mini-batch value: ``actor/pg_loss``, ``actor/kl_loss`` (with KL), ``actor/entropy`` (mean
    over valid tokens), ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``.

    ``logits`` are consumed: backward writes their gradient into their storage (no second
    logits-sized buffer), which is safe for the model's output that megatron's schedule hands over
    and nothing else keeps. A leaf tensor (or a view of one) is left as it is.
    """
    mask = micro_batch["response_mask"].bool()
    # Without an entropy bonus the entropy is only a metric: nothing differentiates it, so backward
    # computes no entropy gradient.
    log_probs, entropy = response_log_probs(
        logits, micro_batch, cfg.temperature, True, cfg.log_prob_chunk_size, reuse_logits=True, fused=cfg.fused_kernels
    )

    pg_loss, pg_metrics = compute_policy_loss(
        cfg.loss_mode, micro_batch["old_log_probs"], log_probs, micro_batch["advantages"], mask, cfg.policy, norm,
        rollout_is_weights=micro_batch.get("rollout_is_weights"),
    )
    norm_kwargs = dict(
        dp_size=norm.dp_size, batch_num_tokens=norm.batch_num_tokens, global_batch_size=norm.global_batch_size
    )
    # Each aggregated term carries a factor dp_size (for DDP's average); metrics drop it.
    loss = pg_loss
    metrics = {"actor/pg_loss": pg_loss.detach().float() / norm.dp_size}

    if cfg.use_kl_loss:
        # Zero both sides at padding: a junk reference value there would otherwise reach the
        # gradient as 0 * NaN through the estimator's backward.
        kl = kl_penalty(
            torch.where(mask, log_probs, 0.0),
            torch.where(mask, micro_batch["ref_log_probs"], 0.0),
            cfg.kl_loss_type,
        )
        kl_loss = agg_loss(kl, mask, cfg.policy.loss_agg_mode, **norm_kwargs)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.detach().float() / norm.dp_size

    if cfg.entropy_coeff != 0:
        loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.policy.loss_agg_mode, **norm_kwargs)

    metrics["actor/entropy"] = agg_loss(
        entropy.detach(), mask, "token-mean", batch_num_tokens=norm.batch_num_tokens
    ).float()
    local_tokens = mask.sum()
    metrics.update({name: _token_weighted(value, local_tokens, norm) for name, value in pg_metrics.items()})
    return loss * norm.num_microbatches, metrics


def log_prob_func(
    temperature: float,
    with_entropy: bool,
    micro_batch: Mapping[str, torch.Tensor],
    logits: torch.Tensor,
    *,
    log_prob_chunk_size: int = DEFAULT_CHUNK_SIZE,
    fused_kernels: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """megatron ``loss_func`` for forward-only passes (old / reference log-probs), e.g.
    ``partial(log_prob_func, cfg.temperature, False, log_prob_chunk_size=cfg.log_prob_chunk_size)``.

    Returns a zero loss and ``{"log_probs": [b, R]}`` plus ``"entropy"`` [b, R] if asked, detached;
    R is the width of ``micro_batch["response_mask"]``.
    """
    log_probs, entropy = response_log_probs(logits, micro_batch, temperature, with_entropy, log_prob_chunk_size,
                                            fused=fused_kernels)
    outputs = {"log_probs": log_probs.detach()}
    if entropy is not None:
        outputs["entropy"] = entropy.detach()
    # megatron scales the returned loss in place, so it must be a fresh tensor.
    return torch.zeros((), device=logits.device), outputs
