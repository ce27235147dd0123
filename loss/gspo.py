"""GSPO: Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071).

The importance ratio is per *sequence*, the geometric mean of the token ratios:
s_i = exp(mean_t log(pi(y_it) / pi_old(y_it))), so it does not grow with
response length, and clipping acts on whole sequences.
"""

import warnings

import torch

from .aggregation import Normalization, agg_loss, masked_row_mean
from .registry import PolicyLossSettings, register_policy_loss
from .surrogate import apply_rollout_is_weights, clipped_surrogate, masked_inputs, policy_metrics

# The paper averages per-sequence losses over sequences.
PAPER_LOSS_AGG_MODE = "seq-mean-token-mean"
# The paper's clip range (§5.1: left 3e-4, right 4e-4; a sequence ratio stays far closer to 1 than
# token ratios) with its aggregation.
PAPER_SETTINGS = PolicyLossSettings(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode=PAPER_LOSS_AGG_MODE)

# Cap on log s_i before exp (verl uses the same bound). Only the top is capped:
# a very negative log ratio just underflows to s_i = 0, which is harmless.
_MAX_LOG_SEQ_RATIO = 10.0

# (mode, loss_agg_mode) pairs already warned about; module state so a training
# loop calling the loss every step warns once per process, not every step.
_warned_agg_modes: set[tuple[str, str]] = set()


def _warn_if_not_paper_agg(loss_mode: str, loss_agg_mode: str) -> None:
    if loss_agg_mode == PAPER_LOSS_AGG_MODE or (loss_mode, loss_agg_mode) in _warned_agg_modes:
        return
    _warned_agg_modes.add((loss_mode, loss_agg_mode))
    warnings.warn(
        f"policy loss {loss_mode!r} with loss_agg_mode={loss_agg_mode!r}: the GSPO paper uses "
        f"{PAPER_LOSS_AGG_MODE!r} (a mean over sequences); other modes weight sequences differently.",
        # Points at the caller of compute_policy_loss (helper -> mode -> dispatcher -> caller).
        stacklevel=4,
    )


def _sequence_log_ratio(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared GSPO preamble: (mask, token log ratio, token advantages, log s_i per row)."""
    mask = response_mask.bool()
    log_ratio, advantages = masked_inputs(old_log_prob, log_prob, advantages, mask)
    # |y_i| is clamped to 1 inside masked_row_mean, so an empty row gets s_i = 1, not NaN.
    return mask, log_ratio, advantages, masked_row_mean(log_ratio, mask)


def _capped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, max=_MAX_LOG_SEQ_RATIO))


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    norm: Normalization,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence-level GSPO: L_i = max(-A_i s_i, -A_i clip(s_i, 1-low, 1+high)).

    A_i is the masked mean of the row's advantages. L_i is broadcast to the
    row's tokens and aggregated with ``agg_loss``; ``seq-mean-token-mean`` gives
    the paper's mean over sequences. ``settings.clip_ratio_c`` is unused (no dual clip).
    """
    mask, log_ratio, advantages, seq_log_ratio = _sequence_log_ratio(old_log_prob, log_prob, advantages, response_mask)
    seq_loss, seq_clipped = clipped_surrogate(
        masked_row_mean(advantages, mask), _capped_exp(seq_log_ratio), settings.clip_ratio_low, settings.clip_ratio_high
    )
    # Broadcasting (not reducing here) lets agg_loss own the weighting and the
    # micro-batch/DP normalisation, exactly as for token-level modes; rollout IS
    # weights then scale each token's copy of L_i.
    loss_mat = apply_rollout_is_weights(seq_loss.unsqueeze(-1).expand_as(log_ratio), rollout_is_weights, mask)
    loss = agg_loss(loss_mat, mask, settings.loss_agg_mode, norm.dp_size, norm.batch_num_tokens, norm.global_batch_size)
    _warn_if_not_paper_agg("gspo", settings.loss_agg_mode)
    metrics = policy_metrics(
        mask, pg_clipfrac=seq_clipped.unsqueeze(-1).expand_as(mask), ppo_kl=-log_ratio, pg_clipfrac_lower=None
    )
    return loss, metrics


@register_policy_loss("gspo_token")
def compute_policy_loss_gspo_token(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    norm: Normalization,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token: s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)] with per-token advantages A_it.

    s_it equals s_i in value but d s_it / d log_prob_t = s_i, so with a constant
    advantage per sequence and ``seq-mean-token-mean`` this matches ``gspo`` in
    loss and gradient, while allowing token-level advantages.
    ``settings.clip_ratio_c`` is unused (no dual clip).
    """
    mask, log_ratio, advantages, seq_log_ratio = _sequence_log_ratio(old_log_prob, log_prob, advantages, response_mask)
    # Built in log space and capped after the sum, so the cap cuts the gradient
    # exactly when it does in ``gspo`` (the two modes stay equivalent there too).
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + (log_ratio - log_ratio.detach())
    loss_mat, clipped = clipped_surrogate(
        advantages, _capped_exp(token_log_ratio), settings.clip_ratio_low, settings.clip_ratio_high
    )
    loss_mat = apply_rollout_is_weights(loss_mat, rollout_is_weights, mask)
    loss = agg_loss(loss_mat, mask, settings.loss_agg_mode, norm.dp_size, norm.batch_num_tokens, norm.global_batch_size)
    _warn_if_not_paper_agg("gspo_token", settings.loss_agg_mode)
    metrics = policy_metrics(mask, pg_clipfrac=clipped, ppo_kl=-log_ratio, pg_clipfrac_lower=None)
    return loss, metrics
