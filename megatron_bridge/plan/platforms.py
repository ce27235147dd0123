"""What each platform is, as the planner and the runtime both need it: its torch.distributed
backend and whether megatron can run context parallel on it. Activating one (imports, adaptors)
is ``megatron_bridge.runtime.platform``'s job; this module imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    name: str  # npu | cuda | cpu
    backend: str  # torch.distributed backend
    # Context parallel needs TE's or MindSpeed's attention; megatron's local attention asserts CP == 1.
    supports_context_parallel: bool


PLATFORMS = {
    "npu": Platform("npu", "hccl", supports_context_parallel=True),
    "cuda": Platform("cuda", "nccl", supports_context_parallel=True),
    "cpu": Platform("cpu", "gloo", supports_context_parallel=False),
}
