"""Per-step training metrics: batch statistics, timing, throughput, MoE router load and peak memory.

Pure torch/python (no Ray): every function takes plain tensors or numbers and returns a flat
``{name: float}`` dict ready for the loggers. Names follow verl
(``verl/trainer/ppo/metric_utils.py``) where the meaning is the same, so dashboards and numbers
carry over between the two code bases.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

_BYTES_PER_GB = 1024**3  # verl reports memory in GiB under the name "GB"; so do we


def _check_vector(name: str, values: torch.Tensor, size: int | None = None) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() == 0:
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"{name} must be a non-empty 1-D tensor (one value per response), got {shape}")
    if size is not None and values.numel() != size:
        raise ValueError(f"{name} has {values.numel()} values but scores has {size}; pass one value per response")


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.double()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def data_metrics(
    scores: torch.Tensor,
    advantages: torch.Tensor,
    response_lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
    max_response_length: int,
    acc: torch.Tensor | None = None,
) -> dict[str, float]:
    """Statistics of one rollout batch, one value per response in every tensor.

    ``critic/score/*``, ``critic/advantages/*``, ``response_length/*``, ``prompt_length/*`` as in
    verl; ``response_length/clip_ratio`` is the fraction of responses that hit
    ``max_response_length`` (truncated, not finished). ``critic/acc/mean`` only when ``acc`` (0/1
    per response) is given: verl's trainer has no training-accuracy metric to copy the name from.
    """
    _check_vector("scores", scores)
    size = scores.numel()
    _check_vector("advantages", advantages, size)
    _check_vector("response_lengths", response_lengths, size)
    _check_vector("prompt_lengths", prompt_lengths, size)
    if max_response_length < 1:
        raise ValueError(f"max_response_length must be >= 1, got {max_response_length}")
    metrics = {
        **_stats("critic/score", scores),
        **_stats("critic/advantages", advantages),
        **_stats("response_length", response_lengths),
        "response_length/clip_ratio": (response_lengths == max_response_length).double().mean().item(),
        **_stats("prompt_length", prompt_lengths),
    }
    if acc is not None:
        _check_vector("acc", acc, size)
        metrics["critic/acc/mean"] = acc.double().mean().item()
    return metrics


def mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Average each key over the optimizer steps that report it (keys may differ between steps)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for step in steps:
        for key, value in step.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


@dataclass
class Timer:
    """Wall-clock sections of a step: ``with timer("gen"): ...`` adds the elapsed seconds to
    ``timer.timings["timing_s/gen"]``. Sections may nest (``step`` around ``gen``) and repeat
    (their times add up); the time is recorded even when the section raises."""

    timings: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        key = f"timing_s/{name}"
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start


def throughput_metrics(total_tokens: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """verl's ``perf/*``: tokens (prompt + response) in the step, step time, and throughput in
    tokens per second per device, i.e. total_tokens / (step_seconds * world_size)."""
    if step_seconds <= 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / (step_seconds * world_size),
    }


def moe_load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Router load balance from ``counts[layer, expert]`` = tokens routed there (top-k assignments).

    - ``moe/load_imbalance_mean``: mean over layers of max/mean of the layer's counts (1.0 = balanced)
    - ``moe/load_imbalance_max``: the worst layer's max/mean
    - ``moe/load_cv``: mean over layers of std/mean (population std; 0.0 = balanced)
    - ``moe/dead_expert_frac``: fraction of (layer, expert) pairs that got no token

    Layers that saw no token at all (e.g. owned by another pipeline stage) are left out of every
    metric; with none left the result is ``{}``.
    """
    if not isinstance(counts, torch.Tensor) or counts.dim() != 2:
        shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"MoE counts must be a 2-D tensor [layers, experts], got {shape}")
    if (counts < 0).any():
        raise ValueError("MoE counts must be >= 0 (tokens per expert); got a negative count")
    counts = counts.double()
    counts = counts[counts.sum(dim=1) > 0]
    if counts.numel() == 0:
        return {}
    layer_mean = counts.mean(dim=1)
    imbalance = counts.max(dim=1).values / layer_mean
    cv = counts.std(dim=1, unbiased=False) / layer_mean
    return {
        "moe/load_imbalance_mean": imbalance.mean().item(),
        "moe/load_imbalance_max": imbalance.max().item(),
        "moe/load_cv": cv.mean().item(),
        "moe/dead_expert_frac": (counts == 0).double().mean().item(),
    }


def memory_metrics(device: str) -> dict[str, float]:
    """Peak memory of this process in GB (GiB, as verl), since start or the last peak reset.

    On ``cuda``/``npu``: ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb`` from
    the accelerator's caching allocator. On ``cpu`` there is no allocator to ask, so
    ``perf/max_memory_allocated_gb`` holds the process's peak resident set size (``ru_maxrss``,
    KiB on Linux) and no reserved figure is reported.
    """
    device_type = device.split(":")[0]
    if device_type == "cpu":
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"perf/max_memory_allocated_gb": peak_kib * 1024 / _BYTES_PER_GB}
    if device_type not in ("cuda", "npu"):
        raise ValueError(f"memory_metrics: unsupported device {device!r}; use 'cpu', 'cuda' or 'npu'")
    # torch.npu exists only once torch_npu is imported (the NPU platform does that at start).
    backend = getattr(torch, device_type, None)
    if backend is None or not backend.is_available():
        raise ValueError(f"memory_metrics: device {device!r} is not available in this process")
    return {
        "perf/max_memory_allocated_gb": backend.max_memory_allocated(device) / _BYTES_PER_GB,
        "perf/max_memory_reserved_gb": backend.max_memory_reserved(device) / _BYTES_PER_GB,
    }
