"""Tolerances for results that differ only in rounding, derived from what is computed.

Two evaluations of one quantity agree only up to rounding when their order of operations differs:
another CPU kernel path (PyTorch picks AVX-512, AVX2 or plain kernels at run time, see
``ATEN_CPU_CAPABILITY``), another split of the batch into micro-batches or ranks, another layout
of the model. That rounding is set by what is summed — how many terms, how large they are — not by
the size of the result: a mean of log-prob differences near 0.01 carries the rounding of
log-probs near 6. So a relative tolerance on a small result is the wrong measure, and a tolerance
tuned until it passes on one machine fails on the next.

The model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §2.8, §4.2): a sum
of n terms of size at most M is exact to within n·u·M in the worst case, and, since rounding
errors behave like independent random variables, typically within sqrt(n)·u·M, u = eps/2 the
unit roundoff. Two evaluations differ by the difference of two such errors (a factor sqrt(2)).
The worst case is far too loose to test anything (n = 2,000 gives 1e-4 relative), so
``rounding`` uses the statistical size with MARGIN standard deviations, which also covers the
largest of the ~1e5 elements compared in a weight tensor (their maximum sits about
sqrt(2 ln 1e5) = 4.8 standard deviations out).

A chain of reductions (a model's forward pass) adds the rounding of each stage, carried forward to
first order: ``forward_terms`` counts the terms along the longest chain of a Qwen3-MoE forward.
"""

from __future__ import annotations

import math

import torch

MARGIN = 6.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def rounding(magnitude: float, terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Absolute tolerance between two evaluations of a quantity computed by summing `terms`
    values of size at most `magnitude` in `dtype`, in any two orders."""
    if magnitude < 0 or terms < 1:
        raise ValueError(f"rounding(magnitude={magnitude}, terms={terms}): need magnitude >= 0 and terms >= 1")
    return MARGIN * math.sqrt(2 * terms) * unit_roundoff(dtype) * magnitude


def forward_terms(spec, seq_len: int) -> int:
    """Terms summed along the longest chain of one Qwen3-MoE forward pass (`spec`: a ModelSpec)
    to a token's log-prob: per layer the q/k/v projections (hidden), the scores (head_dim), the
    weighted values (seq_len), the output projection (q_dim), the router and gate/up projections
    (hidden), the down projection (expert width) and the top-k mix; then the LM head (hidden) and
    the log-softmax over the vocabulary."""
    per_layer = 3 * spec.hidden_size + spec.head_dim + seq_len + spec.q_dim + spec.moe_ffn_hidden_size + spec.moe_topk
    return spec.num_layers * per_layer + spec.hidden_size + spec.vocab_size


def log_prob_tolerance(spec, log_probs: torch.Tensor, seq_len: int) -> float:
    """Two forward passes of the model `spec` (sharded or whole, cached or not, any kernel path)
    that give these log-probs: their rounding through the pass."""
    return rounding(float(log_probs.abs().max()), forward_terms(spec, seq_len))
