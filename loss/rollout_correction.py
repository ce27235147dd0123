"""Train-rollout mismatch metrics and verl's rollout correction (decoupled mode); torch only.

The rollout engine's log-prob of a sampled token (``rollout_log_probs``) differs from the
trainer's (``old_log_probs``, the old-log-prob pass): other kernels, other precision and, for
MoE, other expert choices. ``rollout_mismatch_metrics`` measures the gap; ``rollout_correction``
corrects for it as verl's ``algorithm.rollout_correction`` does with ``bypass_mode: false``:

- importance-sampling (IS) weights pi_old / pi_rollout per token or per sequence, truncated at an
  upper bound (TIS) or zeroed outside [lower, upper] (IcePop), optionally normalised to mean 1.
  The policy loss multiplies them into its per-token loss (``compute_policy_loss(...,
  rollout_is_weights=...)``; the Megatron hook reads them from the micro-batch);
- rejection sampling (RS): tokens or whole sequences whose divergence estimate is out of bounds
  leave the response mask. The caller puts that mask into the batch before the actor counts the
  mini-batch's tokens and sequences, so the global loss normalisation leaves them out as well.

Option names, threshold syntax, formulas and metric names are verl's
(``verl/trainer/ppo/rollout_corr_helper.py``, ``verl/utils/debug/metrics.py``), with one difference
on degenerate input: sequence statistics run over the rows with at least one valid token, where
verl also counts empty rows (as sequences without any gap). Everything is computed in float64 on
the inputs' device, without gradients.
"""

import math
from dataclasses import dataclass

import torch

from .aggregation import masked_mean, masked_row_mean
from .policy import check_shapes

# verl's bound on a log ratio before exp(): weights stay within [e^-20, e^20] ~ [2e-9, 5e8].
SAFETY_BOUND = 20.0
IS_LEVELS: tuple[str, ...] = ("token", "sequence")
RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
# The R3 paper's (arXiv 2510.11370) mark of an extreme token: one policy gives it more than
# twice the other's probability.
EXTREME_TOKEN_RATIO = 2.0
_PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class RsCriterion:
    """One rejection option with its bounds as configured.

    ``*_k1`` options bound a ratio: a token (sequence) stays while lower <= exp(statistic) <= upper,
    where verl's k1 statistic is -log(pi_old / pi_rollout), per token or summed / averaged over the
    sequence. k2 / k3 options keep statistic <= upper and have ``lower=None``.
    """

    option: str
    upper: float
    lower: float | None = None


def _number(text: str, field: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a number") from None


def _bounds(spec: object, field: str, pair_allowed: bool) -> tuple[float | None, float]:
    """(lower, upper) from a number, a number string, or (if allowed) a 'lower_upper' string."""
    form = "a positive number or a 'lower_upper' string such as '0.5_2.0'" if pair_allowed else "a positive number"
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"{field} must be {form}, got {spec!r}")
    text = str(spec).strip()
    if "_" in text:
        if not pair_allowed:
            raise ValueError(f"{field}={spec!r}: a 'lower_upper' pair is only for k1 options; give {form}")
        lower_text, upper_text = text.split("_", 1)
        lower = _number(lower_text, field)
    else:
        lower, upper_text = None, text
    upper = _number(upper_text, field)
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{field}={spec!r}: bounds must be positive with lower <= upper; give {form}")
    return lower, upper


def _rs_criteria(rollout_rs: object, threshold: object) -> tuple[RsCriterion, ...]:
    if not isinstance(rollout_rs, str):
        raise ValueError(f"rollout_rs must be None or a comma-separated string of options, got {rollout_rs!r}")
    # Repeats are dropped, as verl does; order is kept so thresholds pair up with options.
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_rs={rollout_rs!r}: unknown or no option; valid options: {', '.join(RS_OPTIONS)}")
    if threshold is None:
        raise ValueError(
            f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold: one bound for all options or one per option, "
            f"comma-separated; k1 options take 'lower_upper' ratio bounds such as '0.5_2.0'"
        )
    entries = [p.strip() for p in threshold.split(",") if p.strip()] if isinstance(threshold, str) else [threshold]
    if len(entries) == 1:
        entries *= len(options)
    if len(entries) != len(options):
        raise ValueError(
            f"rollout_rs_threshold={threshold!r} has {len(entries)} entries for {len(options)} rollout_rs options; "
            f"give one shared entry or one per option"
        )
    criteria = []
    for option, entry in zip(options, entries):
        is_k1 = option.endswith("k1")
        lower, upper = _bounds(entry, f"rollout_rs_threshold for {option}", pair_allowed=is_k1)
        # verl: a single k1 bound is symmetric in the ratio.
        criteria.append(RsCriterion(option, upper, 1.0 / upper if is_k1 and lower is None else lower))
    return tuple(criteria)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` keys with its yaml defaults; decoupled mode only.

    - ``rollout_is``: None (no weights), ``"token"`` (w_t = pi_old/pi_rollout per token) or
      ``"sequence"`` (w = prod_t w_t, on every token of the row).
    - ``rollout_is_threshold``: a number (or number string) truncates weights at it (TIS); a
      ``"lower_upper"`` string zeroes weights outside [lower, upper] (IcePop). Weights are
      exp(log ratio clamped to +-20) first.
    - ``rollout_rs``: None or comma-separated options of ``RS_OPTIONS``; every option must pass.
      ``rollout_rs_threshold``: one entry for all options or one per option (comma-separated);
      k1 options bound the ratio pi_rollout / pi_old (verl's k1 statistic is its log) with
      ``"lower_upper"`` or one upper bound u (lower 1/u); k2 / k3 options take one upper bound on
      the divergence.
    - ``rollout_is_batch_normalize``: divide the weights by their batch mean (over tokens for
      token weights, over sequences for sequence weights).
    - ``bypass_mode`` and ``loss_type``: only verl's defaults (``False``, ``"ppo_clip"``). Bypass
      mode (pi_old := pi_rollout, the correction computed inside the loss from the current
      policy, and ``loss_type="reinforce"``) is not supported.

    verl's Python dataclass defaults ``rollout_is`` to ``"sequence"``; its yaml, which users set,
    to null, which is followed here.
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    rollout_is_batch_normalize: bool = False

    def __post_init__(self) -> None:
        if self.bypass_mode:
            raise ValueError(
                "bypass_mode=True (old log-probs := rollout log-probs, correction inside the loss) is not "
                "supported here, only verl's decoupled mode: set bypass_mode=False and compute old log-probs"
            )
        if self.loss_type != "ppo_clip":
            raise ValueError(
                f"loss_type={self.loss_type!r} selects a bypass-mode loss, which is not supported here (decoupled "
                f"mode only): use loss_type='ppo_clip'; the policy loss is the actor's loss_mode"
            )
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is={self.rollout_is!r} is unknown; valid: None, {', '.join(IS_LEVELS)}")
        # Parsed now so that a bad threshold fails when the config is built, not at the first step.
        _bounds(self.rollout_is_threshold, "rollout_is_threshold", pair_allowed=True)
        if self.rollout_rs is not None:
            _rs_criteria(self.rollout_rs, self.rollout_rs_threshold)

    @property
    def is_bounds(self) -> tuple[float | None, float]:
        """(lower, upper) for the IS weights: lower None truncates at upper, else zeroes outside."""
        return _bounds(self.rollout_is_threshold, "rollout_is_threshold", pair_allowed=True)

    @property
    def rs_criteria(self) -> tuple[RsCriterion, ...]:
        """The rejection options with their bounds; empty without rejection."""
        return () if self.rollout_rs is None else _rs_criteria(self.rollout_rs, self.rollout_rs_threshold)


@dataclass(frozen=True)
class _Gap:
    """float64 log-probs of both policies, the valid tokens / rows, log(pi_old / pi_rollout) (0 at padding)."""

    old: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor
    log_ratio: torch.Tensor


def _gap(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> _Gap:
    check_shapes(
        "rollout-correction inputs",
        old_log_probs=old_log_probs,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
    )
    mask = response_mask.bool()
    if not mask.any():
        raise ValueError("response_mask has no valid token: call this on a batch with at least one response token")
    old, rollout = old_log_probs.detach().double(), rollout_log_probs.detach().double()
    return _Gap(old, rollout, mask, mask.any(-1), torch.where(mask, old - rollout, 0.0))


def _std(values: torch.Tensor) -> torch.Tensor:
    # Bessel-corrected, as torch.std in verl; a single value has no spread.
    return values.std() if values.numel() > 1 else values.new_zeros(())


def _share(flags: torch.Tensor) -> torch.Tensor:
    return flags.double().mean()


def _token_share(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.double(), mask)


def _pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # NaN where undefined (one token, or one side constant), as verl gets from torch.corrcoef.
    return torch.corrcoef(torch.stack([a, b]))[0, 1] if a.numel() > 1 else a.new_full((), math.nan)


def _floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    # One stacked .tolist() is one device sync for all metrics.
    return dict(zip(metrics, torch.stack([v.double() for v in metrics.values()]).tolist()))


@torch.no_grad()
def rollout_mismatch_metrics(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's, over the valid tokens.

    All inputs [B, R]; pass the response mask before rejection sampling (verl does). Raises
    ValueError if the mask has no valid token. "Sequences" are rows with a valid token; the
    log ratio is lr_t = log pi_old - log pi_rollout and S_i = sum_t lr_t.

    verl's ``calculate_debug_metrics`` (on probabilities p = exp(log-prob)):
    ``training/rollout_probs_diff_mean|max|std`` of |p_old - p_rollout| (std Bessel-corrected,
    0 for one token), ``training/rollout_actor_probs_pearson_corr`` of p_old and p_rollout (NaN
    where undefined: one token, or one side constant).

    verl's ``compute_offpolicy_metrics``, under ``rollout_corr/``: ``kl`` = mean(-lr_t),
    ``k3_kl`` = mean(e^lr_t - lr_t - 1); per sequence the mean log-probs m_old, m_rollout and
    ``training_ppl`` = mean e^-m_old, ``training_log_ppl`` = mean -m_old, ``rollout_ppl``,
    ``rollout_log_ppl`` likewise; d = m_rollout - m_old: ``log_ppl_diff`` = mean d,
    ``log_ppl_abs_diff`` = mean |d|, ``log_ppl_diff_max|min``, ``ppl_ratio`` = mean e^d;
    ``chi2_token`` = mean e^(2 lr_t) - 1 and ``chi2_seq`` = mean e^(2 S_i) - 1 (lr_t and S_i
    clamped to +-20).

    Ours, also under ``rollout_corr/``: ``seq_log_ratio_abs_mean|max`` of |S_i| (the log of each
    sequence's IS ratio, which sequence-level IS and seq_sum_k1 act on), and
    ``extreme_token_frac``: the share of tokens with max(p_old/p_rollout, p_rollout/p_old) > 2
    (the R3 paper's F(tau=2)).
    """
    gap = _gap(old_log_probs, rollout_log_probs, response_mask)
    p_old, p_rollout = gap.old[gap.mask].exp(), gap.rollout[gap.mask].exp()
    probs_diff = (p_old - p_rollout).abs()
    lr = gap.log_ratio[gap.mask]
    seq_lr = gap.log_ratio.sum(-1)[gap.rows]
    m_old = masked_row_mean(gap.old, gap.mask)[gap.rows]
    m_rollout = masked_row_mean(gap.rollout, gap.mask)[gap.rows]
    d = m_rollout - m_old
    metrics = {
        "training/rollout_probs_diff_mean": probs_diff.mean(),
        "training/rollout_probs_diff_max": probs_diff.max(),
        "training/rollout_probs_diff_std": _std(probs_diff),
        "training/rollout_actor_probs_pearson_corr": _pearson(p_old, p_rollout),
        "kl": (-lr).mean(),
        "k3_kl": (lr.exp() - lr - 1).mean(),
        "training_ppl": (-m_old).exp().mean(),
        "training_log_ppl": (-m_old).mean(),
        "rollout_ppl": (-m_rollout).exp().mean(),
        "rollout_log_ppl": (-m_rollout).mean(),
        "log_ppl_diff": d.mean(),
        "log_ppl_abs_diff": d.abs().mean(),
        "log_ppl_diff_max": d.max(),
        "log_ppl_diff_min": d.min(),
        "ppl_ratio": d.exp().mean(),
        "chi2_token": lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().square().mean() - 1,
        "chi2_seq": (2 * seq_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1,
        "seq_log_ratio_abs_mean": seq_lr.abs().mean(),
        "seq_log_ratio_abs_max": seq_lr.abs().max(),
        "extreme_token_frac": _share(lr.abs() > math.log(EXTREME_TOKEN_RATIO)),
    }
    return _floats({(k if k.startswith("training/") else _PREFIX + k): v for k, v in metrics.items()})


def _is_weights(gap: _Gap, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's IS weights [B, R] (0 at padding) and their metrics, before any batch normalisation."""
    lower, upper = cfg.is_bounds
    # Without a lower bound verl still reports the share of weights below 1 / upper.
    mark_low = 1.0 / upper if lower is None else lower
    log_upper, log_low = torch.tensor([upper, mark_low], dtype=torch.float64).log().tolist()
    mask, seq_lr = gap.mask, gap.log_ratio.sum(-1, keepdim=True)
    level_lr = gap.log_ratio if cfg.rollout_is == "token" else seq_lr
    raw = torch.where(mask, level_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), 0.0)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)

    if cfg.rollout_is == "token":
        metrics = {
            "rollout_is_max": weights[mask].max(),
            "rollout_is_min": weights[mask].min(),
            "rollout_is_ratio_fraction_high": _share(raw[mask] > upper),
            "rollout_is_ratio_fraction_low": _share(raw[mask] < mark_low),
        }
    else:
        # From the unclamped sequence log ratios: the true extremes (the max capped to stay finite).
        seq = seq_lr.squeeze(-1)[gap.rows]
        metrics = {
            "rollout_is_max": seq.max().clamp(max=SAFETY_BOUND).exp(),
            "rollout_is_min": seq.min().exp(),
            "rollout_is_ratio_fraction_high": _share(seq > log_upper),
            "rollout_is_ratio_fraction_low": _share(seq < log_low),
        }
    # Weights are <= upper here, so verl's clamp to upper before std and ESS changes nothing.
    mean, second = masked_mean(weights, mask), masked_mean(weights.square(), mask)
    row_means = masked_row_mean(weights, mask)[gap.rows]
    # From the weights before truncation: a mean of truncated weights never exceeds the bound.
    raw_row_means = masked_row_mean(raw, mask)[gap.rows]
    metrics |= {
        "rollout_is_mean": mean,
        "rollout_is_std": (second - mean.square()).clamp(min=0).sqrt() if mask.sum() > 1 else mean.new_zeros(()),
        # 1 / mean((w / mean w)^2); 0 when every weight is 0.
        "rollout_is_eff_sample_size": torch.where(second > 0, mean.square() / second, 0.0),
        "rollout_is_seq_mean": row_means.mean(),
        "rollout_is_seq_std": _std(row_means),
        "rollout_is_seq_max": row_means.max(),
        "rollout_is_seq_min": row_means.min(),
        "rollout_is_seq_max_deviation": (row_means - 1).abs().max(),
        "rollout_is_seq_fraction_high": _share(raw_row_means > upper),
        "rollout_is_seq_fraction_low": _share(raw_row_means < mark_low),
    }
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _token_share((raw < lower) | (raw > upper), mask)
    return weights, metrics


def _row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, 0.0).sum(-1)


def _row_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Empty rows get -inf; only rows with a valid token are ever read.
    return torch.where(mask, values, -torch.inf).amax(-1)


_ROW_STATISTICS = {"seq_sum": _row_sum, "seq_mean": masked_row_mean, "seq_max": _row_max}


def _rejection(gap: _Gap, criteria: tuple[RsCriterion, ...]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's rejection: the tokens [B, R] that every criterion keeps, and the rejection metrics."""
    lr = gap.log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergences = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": lr.exp() - 1 - lr}
    mask, keep_all, metrics = gap.mask, torch.ones_like(gap.mask), {}
    for criterion in criteria:
        level, estimator = criterion.option.rsplit("_", 1)
        stat = divergences[estimator]
        if level == "token":
            per_token, values = stat, stat[mask]
        else:
            per_row = _ROW_STATISTICS[level](stat, mask)
            per_token, values = per_row.unsqueeze(-1).expand_as(stat), per_row[gap.rows]
        # k1 bounds are on the ratio and the statistic is a log; k2 / k3 bound the statistic itself.
        to_statistic = math.log if estimator == "k1" else float
        high = to_statistic(criterion.upper)
        low = None if criterion.lower is None else to_statistic(criterion.lower)
        keep = per_token <= high
        if low is not None:
            keep &= per_token >= low
        keep_all &= keep
        rejected = ~keep & mask
        name = f"rollout_rs_{criterion.option}"
        metrics |= {
            f"{name}_mean": masked_mean(per_token, mask),
            f"{name}_max": values.max(),
            f"{name}_min": values.min(),
            f"{name}_fraction_high": _share(values > high),
            f"{name}_fraction_low": _share(values < low) if low is not None else values.new_zeros(()),
            f"{name}_masked_fraction": _token_share(rejected, mask),
            f"{name}_seq_masked_fraction": _share(rejected.any(-1)[gap.rows]),
        }
    rejected = ~keep_all & mask
    metrics["rollout_rs_masked_fraction"] = _token_share(rejected, mask)
    metrics["rollout_rs_seq_masked_fraction"] = _share(rejected.any(-1)[gap.rows])
    return keep_all, metrics


@torch.no_grad()
def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's decoupled rollout correction of one training batch: (IS weights, response mask, metrics).

    Call it on the whole batch, after the old-log-prob pass and before the actor update: batch
    normalisation averages over what is passed in. Inputs [B, R]; raises ValueError if the mask
    has no valid token.

    - IS weights [B, R] (None if ``cfg.rollout_is`` is None): detached, 0 at padding, in the
      dtype of ``old_log_probs`` (at least float32). Put them into the batch as
      ``rollout_is_weights``.
    - The response mask after rejection, in ``response_mask``'s dtype (a copy of it without
      ``cfg.rollout_rs``). It replaces the batch's ``response_mask``. IS weights are computed on
      the mask before rejection, as verl does.
    - Metrics under ``rollout_corr/`` with verl's names. IS: ``rollout_is_mean|max|min|std``,
      ``rollout_is_eff_sample_size``, ``rollout_is_ratio_fraction_high|low``,
      ``rollout_is_seq_mean|std|max|min|max_deviation|fraction_high|fraction_low``,
      ``rollout_is_oob_ratio`` (with ``lower_upper`` bounds), ``rollout_is_batch_norm_factor``
      (with batch normalisation). RS: ``rollout_rs_masked_fraction``,
      ``rollout_rs_seq_masked_fraction`` and per option ``rollout_rs_<option>_mean|max|min|
      fraction_high|fraction_low|masked_fraction|seq_masked_fraction`` (verl's statistic spread
      and per-sequence summaries of each option are left out). verl's off-policy diagnostics come
      from ``rollout_mismatch_metrics``.
    """
    gap = _gap(old_log_probs, rollout_log_probs, response_mask)
    weights, metrics = None, {}
    if cfg.rollout_is is not None:
        weights, metrics = _is_weights(gap, cfg)
        if cfg.rollout_is_batch_normalize:
            # Over tokens for token weights, over sequences (one weight each) for sequence weights.
            mean = metrics["rollout_is_mean" if cfg.rollout_is == "token" else "rollout_is_seq_mean"]
            normalise = bool(mean > 1e-8)  # all-zero weights (everything out of bounds) stay 0
            weights = weights / mean if normalise else weights
            metrics["rollout_is_batch_norm_factor"] = mean if normalise else torch.ones_like(mean)
        weights = weights.to(torch.promote_types(old_log_probs.dtype, torch.float32))
    new_mask = response_mask.clone()
    if cfg.rollout_rs is not None:
        keep, rs_metrics = _rejection(gap, cfg.rs_criteria)
        new_mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
        metrics |= rs_metrics
    return weights, new_mask, _floats({_PREFIX + k: v for k, v in metrics.items()}) if metrics else {}
