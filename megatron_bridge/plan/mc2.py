"""Rollout-side MC2 facts for vLLM-Ascend: which MoE communication it will pick for a layout and
the HCCL_BUFFSIZE that MC2 needs (launchers set it instead of guessing).

Sources (docs/sources.md, MC2 and HCCL): vllm-ascend ``select_moe_comm_method`` — A3: MC2
while the batch fits the MC2 token capacity, else all-to-all; A2: MC2 only with EP >= 16 and at
most 24 experts per device, else all-gather. Buffer, from the operator's own check (vllm-ascend
PR #5287's error text, its terms spelled out in vllm-ascend PR #3073):
    2 * (maxBs * ep * localExperts * Align512(Align32(2H) + 64) + maxBs * (k + shared) * Align512(2H)) bytes
where maxBs is the tokens one rank sends per MoE call (decode: max_num_seqs / rollout TP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_bridge.plan.layout import Layout
from megatron_bridge.plan.model_spec import ModelSpec

HCCL_DEFAULT_BUFFSIZE_MB = 200
MIB = 1024**2
A2_MIN_EP = 16
A2_MAX_LOCAL_EXPERTS = 24


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Mc2Plan:
    applies: bool  # an NPU layout with expert parallel rollout
    method: str  # mc2 | mc2 (decode) / all-to-all (prefill) | all-gather | n/a
    reason: str
    max_tokens_per_rank: int
    needed_buffsize_mb: int
    hccl_buffsize_mb: int  # what a launcher should export as HCCL_BUFFSIZE


def buffer_bytes(spec: ModelSpec, ep: int, max_tokens_per_rank: int, shared_experts: int = 0) -> int:
    local = spec.num_experts // ep
    dispatch = _align(_align(2 * spec.hidden_size, 32) + 64, 512)
    combine = _align(2 * spec.hidden_size, 512)
    per_call = max_tokens_per_rank * ep * local * dispatch + max_tokens_per_rank * (spec.moe_topk + shared_experts) * combine
    return 2 * per_call


def plan_mc2(spec: ModelSpec, layout: Layout, max_num_seqs: int) -> Mc2Plan:
    r, cl = layout.rollout, layout.cluster
    max_tokens = math.ceil(max_num_seqs / r.tp)
    if cl.device != "npu" or r.ep == 1:
        why = "not an NPU cluster" if cl.device != "npu" else "rollout MoE runs pure TP (expert_parallel_size=1)"
        return Mc2Plan(False, "n/a", why, max_tokens, 0, HCCL_DEFAULT_BUFFSIZE_MB)
    local = spec.num_experts // r.ep
    needed = math.ceil(buffer_bytes(spec, r.ep, max_tokens) / MIB)
    if cl.npu_kind == "a2" and not (r.ep >= A2_MIN_EP and local <= A2_MAX_LOCAL_EXPERTS):
        reason = f"A2 uses MC2 only with EP >= {A2_MIN_EP} and <= {A2_MAX_LOCAL_EXPERTS} experts per device (EP={r.ep}, {local} per device)"
        return Mc2Plan(True, "all-gather", reason, max_tokens, 0, HCCL_DEFAULT_BUFFSIZE_MB)
    if cl.npu_kind == "a2":
        method, reason = "mc2", f"A2 with EP={r.ep} >= {A2_MIN_EP} and {local} experts per device"
    elif cl.npu_kind == "a3":
        method, reason = "mc2 (decode), all-to-all (batches above the MC2 capacity)", "A3 picks MC2 while a batch fits its capacity"
    else:
        method, reason = "unknown", "set trainer.npu_kind (a2 or a3) to know; buffer sized for MC2"
    # Round up to 32 MB and never below HCCL's default.
    return Mc2Plan(True, method, reason, max_tokens, needed, max(HCCL_DEFAULT_BUFFSIZE_MB, _align(needed, 32)))
