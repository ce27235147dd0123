"""What each platform is, as the planner and the runtime both need it: its torch.distributed
backend and whether the actor's Adam runs fused. Activating one (imports, adaptors) is
``megatron_bridge.runtime.platform``'s job; this module imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    name: str  # npu | cuda | cpu
    backend: str  # torch.distributed backend
    # The optimizer step is a fused Adam, with no whole-shard temporaries: TE's or Apex's where
    # megatron finds one, else torch's AdamW on its fused kernel (runtime.megatron_compat.fuse_torch_adam).
    # Not claimed on the NPU, whose optimizer MindSpeed chooses and no one here has measured.
    fused_adam: bool


PLATFORMS = {
    "npu": Platform("npu", "hccl", fused_adam=False),
    "cuda": Platform("cuda", "nccl", fused_adam=True),
    "cpu": Platform("cpu", "gloo", fused_adam=True),
}
