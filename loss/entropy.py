"""Entropy of the categorical distributions given by logits."""

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy over the last dim: logsumexp(z) - sum(softmax(z) * z).

    This form never takes log(p) of an underflowed probability, so it is
    stable for large logits. Low-precision logits (bf16/fp16) are computed and
    returned in float32; float64 stays float64.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
