"""What each platform is, as the planner and the runtime both need it: its torch.distributed
backend. Activating one (imports, adaptors) is ``megatron_bridge.runtime.platform``'s job; this
module imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    name: str  # npu | cuda | cpu
    backend: str  # torch.distributed backend


PLATFORMS = {
    "npu": Platform("npu", "hccl"),
    "cuda": Platform("cuda", "nccl"),
    "cpu": Platform("cpu", "gloo"),
}
