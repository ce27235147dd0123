"""Search for layouts: enumerate TP/PP/EP/ETP layouts of a model on a cluster, keep those the
validator accepts and the memory estimate fits, best first (``python -m megatron_bridge.plan search``)."""

from __future__ import annotations

from dataclasses import replace

from megatron_bridge.plan import memory
from megatron_bridge.plan.batching import TokenBudget
from megatron_bridge.plan.collectives import Groups
from megatron_bridge.plan.layout import Cluster, Layout, RolloutParallel, TrainParallel
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.plan.step_time import CostModel
from megatron_bridge.plan.validate import divisors, rollout_tp_ok
from megatron_bridge.plan.verdict import Verdict, evaluate


def pipeline_options(num_layers: int, pp: int) -> list[dict]:
    """Even split when the layers divide; otherwise the most balanced uneven split (one stage may
    hold a little less, the first or last, where the embedding or the loss also lives)."""
    if num_layers % pp == 0:
        return [{}]
    if pp == 1:
        return []
    per = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * per
    if pp == 2:  # megatron-core 0.12.1 needs a middle stage when both ends are set
        return [{"first_stage_layers": num_layers - per}]
    last = min(per, rest - 1)
    first = rest - last
    return [{"first_stage_layers": first, "last_stage_layers": last}] if first >= 1 else []


def rollout_choice(spec: ModelSpec, cluster: Cluster, utilization: float) -> RolloutParallel:
    """Pure expert parallel rollout with the smallest valid TP whose weights take at most half the
    engine's share (the rest is KV cache); vLLM-Ascend's own advice for these models."""
    w = cluster.world_size
    options = [t for t in divisors(w) if rollout_tp_ok(spec, t) and t <= cluster.devices_per_node]
    for tp in options:
        r = RolloutParallel(tp=tp, dp=w // tp, ep=w, gpu_memory_utilization=utilization)
        if cluster.device_memory_gb is None:
            return r
        share = utilization * cluster.device_memory_gb * memory.GIB
        if memory.rollout_weight_bytes(spec, Layout("", rollout=r, cluster=cluster)) <= share / 2:
            return r
    tp = options[-1] if options else 1
    return RolloutParallel(tp=tp, dp=w // tp, ep=w, gpu_memory_utilization=utilization)


def candidates(spec: ModelSpec, cluster: Cluster, recompute: bool, utilization: float, offload: bool):
    w = cluster.world_size
    rollout = rollout_choice(spec, cluster, utilization)
    for tp in divisors(w):
        for pp in divisors(w // tp):
            for split in pipeline_options(spec.num_layers, pp):
                for etp in sorted({1, tp}):
                    for ep in divisors(spec.num_experts):
                        if w % (etp * ep * pp):
                            continue
                        train = TrainParallel(
                            tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1,
                            recompute_granularity="full" if recompute else None,
                            recompute_method="uniform" if recompute else None,
                            recompute_num_layers=1 if recompute else None,
                            param_offload=offload, grad_offload=offload, optimizer_offload=offload, **split,
                        )
                        name = f"{spec.name}_tp{tp}_pp{pp}_ep{ep}_etp{etp}"
                        yield Layout(name, train=train, rollout=rollout, cluster=cluster)


COMFORTABLE_FRACTION = 0.8  # estimates are estimates: prefer layouts that leave a fifth free


def _tight(v: Verdict) -> bool:
    m = v.memory
    return m.device_bytes is not None and m.train_peak > COMFORTABLE_FRACTION * m.device_bytes


def rank_key(v: Verdict, devices_per_node: int):
    """With a predicted step: memory to spare first, then the fastest step. Without one (no rates
    known), and between equal steps, the rules of thumb: TP inside a node, memory to spare, fewer
    stages and TP, whole experts, more expert shards, lower peak."""
    t = v.layout.train
    cross_node_tp = t.tp > devices_per_node
    rules = (cross_node_tp, _tight(v), t.pp, t.tp, t.expert_tp, -t.ep, v.memory.train_peak)
    return rules if v.step is None else (_tight(v), v.step.total, *rules)


# The training's communication and idle terms (step_time.TERMS), as the table's last column names them.
_SHORT = {"tensor_parallel": "TP", "expert_all_to_all": "expert dispatch", "context_parallel": "CP",
          "pipeline_bubble": "bubble", "pipeline_p2p": "PP p2p", "gradient_sync": "grad reduce-scatter",
          "parameter_gather": "param all-gather"}


def why(v: Verdict, devices_per_node: int) -> str:
    t = v.layout.train
    parts = [] if t.tp <= devices_per_node else ["TP crosses nodes (slow)"]
    ep = Groups.of(v.layout).ep
    if t.ep > 1:
        nodes = -(-t.ep // ep.members_per_node(devices_per_node))
        parts.append(f"EP{t.ep} " + (f"across {nodes} nodes" if ep.crosses_nodes(devices_per_node) else "inside a node"))
    if v.step is not None:
        biggest = max(_SHORT, key=v.step.seconds.__getitem__)
        if v.step.seconds[biggest]:
            parts.append(f"most communication: {_SHORT[biggest]} {v.step.seconds[biggest] / v.step.total:.0%}")
    else:
        parts.append("no pipeline bubble" if t.pp == 1 else f"{t.pp} pipeline stages")
    if v.memory.device_bytes:
        share = v.memory.train_peak / v.memory.device_bytes
        parts.append(f"peak {share:.0%} of device" + (" (tight)" if _tight(v) else ""))
    return ", ".join(parts)


def search(spec: ModelSpec, cluster: Cluster, seq_len: int, micro_batch: float | TokenBudget, recompute: bool,
           utilization: float, offload: bool, include_oom: bool, reference: bool = False, packed: bool = True,
           log_prob_chunk_size: int = memory.LOG_PROB_CHUNK_TOKENS, cost: CostModel | None = None,
           log_prob: float | TokenBudget | None = None) -> list[Verdict]:
    """Valid layouts (with ``include_oom``, those that do not fit too, after the ones that do),
    each with its predicted step where ``cost`` is given, best first (``rank_key``)."""
    verdicts = []
    for layout in candidates(spec, cluster, recompute, utilization, offload):
        v = evaluate(spec, layout, seq_len, micro_batch, reference, packed, log_prob_chunk_size, log_prob=log_prob)
        if v.memory is None:
            continue  # search shows structurally valid layouts only
        if v.valid or include_oom:
            verdicts.append(replace(v, step=cost.predict(spec, layout)) if cost else v)
    return sorted(verdicts, key=lambda v: (not v.valid, rank_key(v, cluster.devices_per_node)))
