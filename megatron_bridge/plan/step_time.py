"""Predicted time of one RL step of a layout: compute, each collective, the pipeline bubble, the
rollout and the weight sync (``predict``). An ESTIMATE from FLOPs and bytes at the rates of
``hardware``; what it counts and assumes is stated where it is computed, and in docs/launch.md.

One RL step: the rollout generates ``global_batch`` responses; the weights go to the rollout engine
(weight sync); the actor computes their log-probs (and a reference model's, with ``reference``);
then trains on them in ``global_batch / mini_batch`` optimizer steps of micro-batches through the
pipeline (1F1B, or interleaved with VPP), each optimizer step ending with the distributed
optimizer's gradient reduce-scatter and parameter all-gather. Colocated (the hybrid engine), the
phases run one after another; with a rollout pool of its own, the rollout of the next step runs
while this one trains (one step off), so the step takes the longer of the two plus the sync.

Per device: the pipeline runs at its slowest stage's pace, and a stage's work per micro-batch is
shared evenly by its TP*CP ranks (the dense part) and its experts' ranks (the routed tokens), so
each device computes 1/(TP*CP) of its stage's micro-batch. Micro-batches are packed, and every
sequence is taken at the mean length (which understates attention's s^2 when lengths spread). The
kernel path counts where it changes the work: megatron's local attention adds its scores' memory
traffic; grouped or sequential experts are the same FLOPs at the same rate. Fixed costs count where
the sheet measured them (``hardware.Overheads``, 0 otherwise): each collective launch's latency,
n-1 times the sheet's over a group of n (``launch_seconds``)
(per layer and pass: TP 2, EP dispatch and combine 2, ETP 2, CP's ring steps CP-1; on CPU ranks,
whose actor builds megatron's allgather MoE dispatcher, its 4 launches forward and 3 backward over
ETP x EP in place of the all-to-all; under TP the embedding's, the output layer's and the log-probs'
launches (``edge_launches``); a pipeline send;
one reduce-scatter and one all-gather, or one all-reduce, per gradient group, the buffers taken as
one bucket; where the sheet's ranks share the cores, at least two a core, no pipeline bubble:
``bubble_seconds``), each decoder layer's per-micro-batch forward and backward cost beyond its FLOPs
(on a device of a few cores, Python and kernel launches) and what it adds under TP and under EP
(``layer_fixed_seconds``: the sequence-parallel gathers' and the MoE dispatcher's work outside their
collectives, smaller GEMMs' lower rate; measured at TP2 and EP2, taken for any degree), and the rest of the model's (embedding,
output layer, log-probs, and in training the schedule's and the policy loss's; counted on the last
stage), and an optimizer step's beyond its Adam bytes (the gradient norm with its all-reduce, the
clip, the step's metric sums) and per decoder layer of the stage (the update's and the norm's work
tensor by tensor). The optimizer's update counts its Adam bytes at the memory rate
(``optimizer_update_seconds``). Not counted: the offload to and from the host, expert load
imbalance, and on a sheet without the TP and EP layer figures (every NPU and GPU sheet) what TP and
EP add to a layer beyond their collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan import flops
from megatron_bridge.plan.batching import TokenBudget, replicas
from megatron_bridge.plan.collectives import AllToAll, Group, Groups, link_rate, ring_bytes, ring_seconds
from megatron_bridge.plan.hardware import Assumptions, Rates
from megatron_bridge.plan.layout import Layout, TrainParallel
from megatron_bridge.plan.memory import (GIB, GRAD_BYTES, LOG_PROB_CHUNK_TOKENS, LOG_PROB_CHUNKS_AT_LEAST, PARAM_BYTES,
                                         chunk_params, rollout_weight_bytes)
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.plan.stages import layers_per_stage

ACTIVATION_BYTES = 2  # bf16 activations, tokens and gradients on the wire
# megatron's local attention (use_flash_attn=false) writes and reads its [s, s] scores in memory:
# what it keeps per score in forward and works with in backward (memory.activation_bytes_per_layer,
# memory.attention_working_bytes); the fused kernels work in tiles and move none of it
LOCAL_ATTENTION_FORWARD_BYTES = 6
LOCAL_ATTENTION_BACKWARD_BYTES = 12


@dataclass(frozen=True)
class Workload:
    """One RL step's sequences. Defaults (``cli``): configs/recipe/qwen3_30b_a3b_gspo.yaml's."""

    seq_len: int  # the longest sequence, prompt + response (what memory is planned for)
    prompt_len: int  # mean prompt tokens
    response_len: int  # mean response tokens; the longest is seq_len - prompt_len
    global_batch: int  # sequences per RL step (prompts x responses per prompt)
    mini_batch: int  # sequences per optimizer step
    micro_batch_size: float = 1
    reference: bool = False  # a reference model's log-prob pass too (KL)
    max_token_len: int | None = None  # dynamic batch size: tokens per device a micro-batch holds
    log_prob_max_token_len: int | None = None  # the log-prob passes' own budget (default: max_token_len)
    log_prob_micro_batch_size: float | None = None  # or their own rows (default: the training micro-batch)

    def sized(self, layout: Layout, step_rows: int, budget: int | None) -> Workload:
        """This workload with micro-batches of ``micro_batch_size`` sequences: where a token ``budget``
        cuts them, as many of the mean length as it holds (at most a DP rank's share of ``step_rows``)."""
        if budget is None:
            return self
        return replace(self, micro_batch_size=TokenBudget(budget, step_rows).rows(layout, self.mean_len))

    def log_prob_sized(self, layout: Layout) -> Workload:
        """This workload with the log-prob passes' micro-batches: their own rows or budget where given,
        else the training micro-batch's rows or budget (over an RL step's rows)."""
        if self.log_prob_micro_batch_size is not None:
            return replace(self, micro_batch_size=self.log_prob_micro_batch_size)
        return self.sized(layout, self.global_batch, self.log_prob_max_token_len or self.max_token_len)

    def __post_init__(self):
        if self.prompt_len >= self.seq_len:
            raise ConfigError(f"--prompt-len {self.prompt_len} leaves no room for a response in --seq-len {self.seq_len}")
        if self.prompt_len + self.response_len > self.seq_len:
            raise ConfigError(f"prompt ({self.prompt_len}) + mean response ({self.response_len}) tokens exceed "
                              f"--seq-len {self.seq_len}, the longest sequence")
        if self.global_batch % self.mini_batch:
            raise ConfigError(f"--mini-batch {self.mini_batch} must divide --global-batch {self.global_batch}")

    @property
    def mean_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def longest_response(self) -> int:
        return self.seq_len - self.prompt_len

    @property
    def optimizer_steps(self) -> int:
        return self.global_batch // self.mini_batch


# The breakdown's terms, in print order: (key, label).
TERMS = (
    ("compute", "compute (train fwd+bwd+recompute, log-probs)"),
    ("tensor_parallel", "TP / SP all-gather, reduce-scatter"),
    ("expert_all_to_all", "EP all-to-all (dispatch, combine) + ETP"),
    ("context_parallel", "CP key/value exchange"),
    ("pipeline_bubble", "pipeline bubble"),
    ("pipeline_p2p", "pipeline send / receive"),
    ("gradient_sync", "DP / EDP gradient reduce-scatter"),
    ("parameter_gather", "DP / EDP parameter all-gather"),
    ("optimizer", "optimizer update (Adam)"),
    ("rollout", "rollout (prefill + decode)"),
    ("weight_sync", "weight sync to the rollout"),
)


@dataclass(frozen=True)
class StepTime:
    """Seconds per RL step, by term (``TERMS``), and how they add up (``schedule``)."""

    seconds: dict[str, float]
    total: float
    schedule: str
    decode_tokens_per_s: float  # the whole rollout's generated tokens per second
    rates: Rates
    assumptions: Assumptions


def bubble_seconds(pp: int, vpp: int | None, stage_seconds: float, ranks_share_cores: bool = False) -> float:
    """A pipeline schedule's idle time on a stage: (PP-1)/VPP micro-batches' worth (1F1B: VPP=1;
    Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters', §2.2).
    No idle time where the ranks share the cores at least two a core (a sheet's ``ranks_share_cores``): the
    idle stage's cores run the busy stage, whose compute was priced at the rate of every rank busy,
    so the step is its ranks' work over the cores, bubble or not."""
    return 0.0 if ranks_share_cores else (pp - 1) / (vpp or 1) * stage_seconds


def bubble_fraction(pp: int, vpp: int | None, micro_batches: int) -> float:
    """The bubble's share of a schedule of ``micro_batches``: (PP-1) / (VPP*m + PP-1)."""
    idle = bubble_seconds(pp, vpp, 1.0)
    return idle / (micro_batches + idle)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's seconds on one device of a stage, for one kind of pass."""

    compute: float
    tensor_parallel: float
    expert_all_to_all: float
    context_parallel: float
    pipeline_p2p: float

    @property
    def stage_seconds(self) -> float:
        """What the next stage waits for (the p2p is counted on its own)."""
        return self.compute + self.tensor_parallel + self.expert_all_to_all + self.context_parallel


def tp_bytes_per_layer(spec: ModelSpec, layout: Layout, tokens: int) -> float:
    """Bytes one device sends for one layer's forward under TP: with sequence parallel, an
    all-gather before the attention and a reduce-scatter after it of the [tokens/CP, h] activation
    (the MoE layer runs on the sequence shard with the all-to-all dispatcher); without, an
    all-reduce after the attention and after the MoE layer."""
    t = layout.train
    full = tokens / t.cp * spec.hidden_size * ACTIVATION_BYTES
    return 2 * ring_bytes(full, t.tp) * (1 if t.sequence_parallel else 2)


def expert_dispatch_bytes(spec: ModelSpec, layout: Layout, tokens: int) -> float:
    """Bytes of one all-to-all (dispatch, or combine) on one device: its tokens/(TP*CP), each sent
    to top-k experts, h bf16 values each (of which 1/EP stays on the device)."""
    t = layout.train
    return tokens / (t.tp * t.cp) * spec.moe_topk * spec.hidden_size * ACTIVATION_BYTES


def cp_bytes_per_layer(spec: ModelSpec, layout: Layout, tokens: int) -> float:
    """Bytes one device sends for one layer's forward under CP: its K and V chunk (tokens/CP, the
    key/value heads on this TP rank) passed CP-1 times around the ring."""
    t = layout.train
    return (t.cp - 1) * tokens / t.cp * 2 * spec.kv_dim / t.tp * ACTIVATION_BYTES


def micro_batch(spec: ModelSpec, layout: Layout, layers: int, last_stage: bool, w: Workload, rates: Rates,
                training: bool, first_stage: bool = False) -> MicroBatch:
    """A stage's micro-batch: training (forward, backward, the recompute's forward) or a log-prob
    forward. Collectives run once per forward and once (transposed) in backward; CP's backward
    sends keys, values and their gradients, twice the forward's bytes."""
    t, g, dpn = layout.train, Groups.of(layout), layout.cluster.devices_per_node
    s, b = w.mean_len, w.micro_batch_size
    tokens = s * b
    recompute = training and t.recompute_granularity == "full"
    passes = (3 + recompute) if training else 1  # forward 1, backward 2, recompute 1 (FLOPs)
    collective_passes = (2 + recompute) if training else 1
    cp_passes = (3 + recompute) if training else 1
    work = layers * b * flops.layer_forward_flops(spec, s) * passes
    if last_stage:
        work += flops.logits_flops(spec, tokens) * (3 if training else 1)
    compute = work / (t.tp * t.cp) / rates.flops
    # fixed per layer, whatever the tokens: not shared by TP or CP (every rank runs each layer)
    forward, backward = layer_fixed_seconds(layout, rates)
    compute += layers * ((1 + recompute) * forward + backward if training else forward)
    if last_stage:  # the rest of the model's fixed cost (embedding, output layer, log-probs), taken on the last stage
        compute += rates.micro_batch_forward + (rates.micro_batch_backward if training else 0.0)
    if not t.flash_attn:  # the local attention's scores are memory-bound: their bytes at the HBM rate
        per_score = (LOCAL_ATTENTION_FORWARD_BYTES * (1 + recompute) + LOCAL_ATTENTION_BACKWARD_BYTES
                     if training else LOCAL_ATTENTION_FORWARD_BYTES)
        compute += layers * b * spec.num_attention_heads / t.tp * s**2 / t.cp * per_score / rates.hbm

    a2a = AllToAll.of(expert_dispatch_bytes(spec, layout, tokens), g.ep, dpn)
    routed_full = expert_dispatch_bytes(spec, layout, tokens) * t.expert_tp  # ETP gathers the routed tokens
    per_layer_expert = 2 * a2a.seconds(rates) + 2 * ring_seconds(routed_full, g.etp, rates, dpn)
    launches = launches_per_layer(layout)
    expert_forward = expert_backward = per_layer_expert + (launches["expert_all_to_all"] * launch_seconds(g.ep, rates)
                                                           + launches["expert_tp"] * launch_seconds(g.etp, rates))
    if dispatcher(layout) == "allgather":
        expert_forward, expert_backward = allgather_dispatch_seconds(spec, layout, tokens, rates)
    boundary = tokens / t.cp * spec.hidden_size * ACTIVATION_BYTES / (t.tp if t.sequence_parallel else 1)
    sends = (2 if training else 1) * (t.vpp or 1) if t.pp > 1 else 0  # activation forward, its gradient back
    # launches per layer and pass (launches_per_layer), each at the measured latency (0 on a sheet without one)
    tp_bytes = tp_bytes_per_layer(spec, layout, tokens)
    return MicroBatch(
        compute=compute,
        tensor_parallel=layers * collective_passes * (tp_bytes / link_rate(g.tp, rates, dpn)
                                                      + launches["tensor_parallel"] * launch_seconds(g.tp, rates))
        + edge_launches(layout, w, first_stage, last_stage, training) * launch_seconds(g.tp, rates),
        expert_all_to_all=layers * ((1 + recompute) * expert_forward + expert_backward if training else expert_forward),
        context_parallel=layers * cp_passes * (cp_bytes_per_layer(spec, layout, tokens) / link_rate(g.cp, rates, dpn)
                                               + launches["context_parallel"] * rates.latency),
        pipeline_p2p=sends * (boundary / link_rate(g.pp, rates, dpn) + rates.latency),
    )


def layer_fixed_seconds(layout: Layout, rates: Rates) -> tuple[float, float]:
    """A decoder layer's fixed (forward, backward) seconds per micro-batch: the sheet's layer's, and
    what the sheet says the layer adds under TP > 1 and under EP > 1."""
    t = layout.train
    return (rates.layer_forward + (t.tp > 1) * rates.tp_layer_forward + (t.ep > 1) * rates.ep_layer_forward,
            rates.layer_backward + (t.tp > 1) * rates.tp_layer_backward + (t.ep > 1) * rates.ep_layer_backward)


def dispatcher(layout: Layout) -> str:
    """megatron's MoE token dispatcher the actor builds (``megatron_bridge.runtime.model``): the
    all-to-all one, or on CPU gloo ranks the allgather one."""
    return "allgather" if layout.cluster.device == "cpu" else "alltoall"


def allgather_dispatch_seconds(spec: ModelSpec, layout: Layout, tokens: int, rates: Rates) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's allgather dispatcher (megatron-core 0.12.1
    ``MoEAllGatherTokenDispatcher``) over the ETP x EP group (``tp_ep_group``, the expert tensor and
    model parallel group): forward all-gathers the routing map,
    the probabilities and the hidden states of every member's tokens, then reduce-scatters the
    output (4 launches); backward reduce-scatters the probabilities' and hidden states' gradients
    and all-gathers the output's (3). The hidden states' ring carries the bytes (the map and the
    probabilities are top-k x experts bytes a token, left out)."""
    t = layout.train
    group = Group(t.expert_tp * t.ep, 1)
    if group.size == 1:
        return 0.0, 0.0
    local = tokens / t.cp / (t.tp if t.sequence_parallel else 1) * spec.hidden_size * ACTIVATION_BYTES
    moved = 2 * ring_seconds(local * group.size, group, rates, layout.cluster.devices_per_node)
    return moved + 4 * launch_seconds(group, rates), moved + 3 * launch_seconds(group, rates)


def edge_launches(layout: Layout, w: Workload, first_stage: bool, last_stage: bool, training: bool) -> int:
    """TP launches of a micro-batch outside the layers (their bytes are small and left out): the
    vocabulary-parallel embedding's reduce (and with SP its gradient's all-gather), the output
    layer's SP all-gather (and its input gradient's reduce), and the log-probs' two all-reduces a
    chunk (``loss.vocab_parallel``: chunks of min(LOG_PROB_CHUNK_TOKENS, M/16) of the M tokens'
    rows over the response tokens; none in backward)."""
    t = layout.train
    if t.tp == 1:
        return 0
    n = 0
    if first_stage:
        n += 1 + (training and t.sequence_parallel)
    if last_stage:
        tokens, scored = w.mean_len * w.micro_batch_size, w.response_len * w.micro_batch_size
        rows = min(LOG_PROB_CHUNK_TOKENS, math.ceil(tokens / LOG_PROB_CHUNKS_AT_LEAST))
        n += t.sequence_parallel + training + 2 * math.ceil(scored / rows)
    return n


def launches_per_layer(layout: Layout) -> dict[str, int]:
    """Collective launches of one layer's forward, by group (the backward runs them again): TP's
    all-gather and reduce-scatter (with SP) or two all-reduces; EP's dispatch and combine, and ETP's
    gather and scatter of the routed tokens (the all-to-all dispatcher; ``allgather_dispatch_seconds``
    counts the other); CP's CP-1 ring steps (each a send to the next rank)."""
    t = layout.train
    return {"tensor_parallel": 2 if t.tp > 1 else 0, "expert_all_to_all": 2 if t.ep > 1 else 0,
            "expert_tp": 2 if t.expert_tp > 1 else 0, "context_parallel": t.cp - 1}


def launch_seconds(group: Group, rates: Rates) -> float:
    """The latency of one collective over ``group``: the sheet's latency (one step) for each of the
    n - 1 steps of a ring all-gather or reduce-scatter (the latency term of the alpha-beta model,
    Thakur, Rabenseifner and Gropp 2005), an all-to-all's n - 1 exchanges, and an all-reduce taken
    alike; a point-to-point send is one step."""
    return (group.size - 1) * rates.latency


@dataclass(frozen=True)
class GradientSync:
    """Bytes through one device per optimizer step, and seconds: the distributed optimizer
    reduce-scatters fp32 gradients and all-gathers bf16 parameters over DP*CP (dense) and EDP
    (experts, EP > 1); without it, one fp32 all-reduce (twice a ring's bytes)."""

    reduce_bytes: float
    gather_bytes: float
    reduce_seconds: float
    gather_seconds: float


def stage_params(spec: ModelSpec, t: TrainParallel, pp_rank: int) -> list:
    """The parameters one device of pipeline stage ``pp_rank`` holds, over its model chunks."""
    return [p for vp in range(t.vpp or 1) for p in chunk_params(spec, t, pp_rank, vp)]


def gradient_sync(spec: ModelSpec, layout: Layout, pp_rank: int, rates: Rates) -> GradientSync:
    t, g, dpn = layout.train, Groups.of(layout), layout.cluster.devices_per_node
    params = stage_params(spec, t, pp_rank)
    reduce_bytes = gather_bytes = reduce_s = gather_s = 0.0
    for expert, group in ((False, g.dp), (True, g.edp)):
        numel = sum(p.numel for p in params if p.expert == expert)
        if group.size == 1 or not numel:
            continue
        rate = link_rate(group, rates, dpn)
        if t.use_distributed_optimizer:
            r, a = ring_bytes(numel * GRAD_BYTES, group.size), ring_bytes(numel * PARAM_BYTES, group.size)
        else:
            r, a = 2 * ring_bytes(numel * GRAD_BYTES, group.size), 0.0
        reduce_bytes, gather_bytes = reduce_bytes + r, gather_bytes + a
        # one launch each (the buffers as one bucket), at the measured latency
        reduce_s = reduce_s + r / rate + launch_seconds(group, rates)
        gather_s = gather_s + (a / rate + launch_seconds(group, rates) if a else 0.0)
    return GradientSync(reduce_bytes, gather_bytes, reduce_s, gather_s)


# fp32 Adam per parameter of the device's optimizer shard: reads the main parameter, its gradient and
# both moments, writes the parameter and both moments back (4 bytes each)
ADAM_BYTES = 7 * 4


def optimizer_update_seconds(spec: ModelSpec, layout: Layout, pp_rank: int, rates: Rates) -> float:
    """One optimizer step's update on one device of stage ``pp_rank``: Adam over its shard at the
    memory rate (the distributed optimizer's shard: 1/(DP*CP) of the dense parameters, 1/EDP of the
    experts'), plus the sheet's fixed costs: per step (``Overheads.optimizer_step_us``) and per
    decoder layer of the stage (``optimizer_layer_us``: measured at one DP, taken for any)."""
    t, g = layout.train, Groups.of(layout)
    params = stage_params(spec, t, pp_rank)
    shard = sum(p.numel / ((g.edp if p.expert else g.dp).size if t.use_distributed_optimizer else 1) for p in params)
    layers = layers_per_stage(spec.num_layers, t)[pp_rank]
    return rates.optimizer_step + layers * rates.optimizer_layer + shard * ADAM_BYTES / rates.hbm


def weight_sync_bytes(spec: ModelSpec, layout: Layout) -> tuple[float, int]:
    """(bytes, hops) of one weight sync on the busiest receiver (``megatron_bridge.weights.export``):
    colocated, each rank receives the dense tensors whole and its rollout rank's experts (1/rollout
    EP of them), bf16; with a pool of its own, rank 0 receives the whole model, then broadcasts it
    to the pool (two hops)."""
    experts = spec.num_layers * spec.num_experts * spec.expert_params * PARAM_BYTES
    dense = spec.total_params * PARAM_BYTES - experts
    if layout.separate_rollout:
        return dense + experts, 2
    return dense + experts / layout.rollout.ep, 1


def rollout_seconds(spec: ModelSpec, layout: Layout, w: Workload, rates: Rates) -> float:
    """Prefill at the compute rate, then decode steps, each the slower of reading the device's
    rollout weights and its sequences' KV cache (memory) and computing the batch's next tokens.
    A DP rank of TP devices holds global_batch/DP sequences and runs as many at a time as
    max_num_seqs and its KV cache (the engine's memory share less its weights, at the mean context)
    allow; it decodes until its longest response ends: (waves - 1) mean responses, then the
    longest. The MoE all-to-all of decoding is latency-bound, and not counted."""
    r, cl = layout.rollout, layout.cluster
    per_rank = math.ceil(w.global_batch / r.dp)
    context = w.prompt_len + w.response_len / 2
    kv_per_token = 2 * spec.kv_dim * ACTIVATION_BYTES * spec.num_layers / r.tp
    weights = rollout_weight_bytes(spec, layout)
    concurrent = min(per_rank, r.max_num_seqs)
    if cl.device_memory_gb:
        kv_budget = r.gpu_memory_utilization * cl.device_memory_gb * GIB - weights
        concurrent = max(1, min(concurrent, int(kv_budget / (context * kv_per_token))))
    waves = math.ceil(per_rank / concurrent)
    steps = (waves - 1) * w.response_len + w.longest_response
    prefill = per_rank * spec.num_layers * flops.layer_forward_flops(spec, w.prompt_len) / r.tp / rates.flops
    memory = (weights + concurrent * context * kv_per_token) / rates.hbm
    compute = concurrent * flops.decode_flops_per_token(spec, int(context)) / r.tp / rates.flops
    return prefill + steps * max(memory, compute)


@dataclass(frozen=True)
class CostModel:
    """What ``predict`` needs besides the model and the layout."""

    workload: Workload
    rates: Rates
    assumptions: Assumptions

    def predict(self, spec: ModelSpec, layout: Layout) -> StepTime:
        return predict(spec, layout, self.workload, self.rates, self.assumptions)


def _slowest(spec: ModelSpec, layout: Layout, w: Workload, rates: Rates, training: bool) -> MicroBatch:
    """The micro-batch of the pipeline's slowest stage."""
    t = layout.train
    return max((micro_batch(spec, layout, n, i == t.pp - 1, w, rates, training, first_stage=i == 0)
                for i, n in enumerate(layers_per_stage(spec.num_layers, t))), key=lambda m: m.stage_seconds)


PASS_TERMS = ("compute", "tensor_parallel", "expert_all_to_all", "context_parallel", "pipeline_p2p")


def optimizer_step(spec: ModelSpec, layout: Layout, w: Workload, rates: Rates, assume: Assumptions) -> dict[str, float]:
    """Seconds of one optimizer step of ``w.mini_batch`` sequences, by training term (the terms of
    ``TERMS`` before the rollout's): its micro-batches through the pipeline, then the gradient
    reduce-scatter and parameter all-gather, and the update on the slowest stage. What one actor
    ``train_step`` takes (bench/actor_throughput.py's train step; bench/plan_calibrate.py compares
    them)."""
    t, w = layout.train, w.sized(layout, w.mini_batch, w.max_token_len)
    per_opt = math.ceil(math.ceil(w.mini_batch / replicas(layout)) / w.micro_batch_size)
    train = _slowest(spec, layout, w, rates, True)
    sync = max((gradient_sync(spec, layout, i, rates) for i in range(t.pp)),
               key=lambda s: s.reduce_seconds + s.gather_seconds)
    # overlapped, each sync hides behind one micro-batch's compute (the last backward, the first forward)
    hide = train.compute if assume.overlap_grad_sync else 0.0
    return {**{k: per_opt * getattr(train, k) for k in PASS_TERMS},
            "pipeline_bubble": bubble_seconds(t.pp, t.vpp, train.stage_seconds, rates.ranks_share_cores),
            "gradient_sync": max(0.0, sync.reduce_seconds - hide),
            "parameter_gather": max(0.0, sync.gather_seconds - hide),
            "optimizer": max(optimizer_update_seconds(spec, layout, i, rates) for i in range(t.pp))}


def log_prob_pass(spec: ModelSpec, layout: Layout, w: Workload, rates: Rates) -> dict[str, float]:
    """Seconds of one log-prob pass over the ``w.global_batch`` sequences (forward only), by term."""
    t, w = layout.train, w.log_prob_sized(layout)
    per_pass = math.ceil(math.ceil(w.global_batch / replicas(layout)) / w.micro_batch_size)
    forward = _slowest(spec, layout, w, rates, False)
    return {**{k: per_pass * getattr(forward, k) for k in PASS_TERMS},
            "pipeline_bubble": bubble_seconds(t.pp, t.vpp, forward.stage_seconds, rates.ranks_share_cores)}


def predict(spec: ModelSpec, layout: Layout, w: Workload, rates: Rates, assume: Assumptions) -> StepTime:
    """The RL step's predicted seconds, by term, for a validated layout."""
    cl = layout.cluster
    train = optimizer_step(spec, layout, w, rates, assume)
    forward = log_prob_pass(spec, layout, w, rates)
    log_prob_passes = 1 + w.reference
    sync_bytes, hops = weight_sync_bytes(spec, layout)
    weights_rate = rates.inter if cl.nnodes > 1 or layout.separate_rollout else rates.intra
    seconds = {k: w.optimizer_steps * v + log_prob_passes * forward.get(k, 0.0) for k, v in train.items()}
    seconds |= {
        "rollout": rollout_seconds(spec, layout, w, rates),
        "weight_sync": hops * sync_bytes / weights_rate,
    }
    seconds = {k: seconds[k] for k, _ in TERMS}
    training = sum(v for k, v in seconds.items() if k not in ("rollout", "weight_sync"))
    if layout.separate_rollout:
        total = max(training, seconds["rollout"]) + seconds["weight_sync"]
        schedule = "rollout pool of its own, one step off: max(rollout, training) + weight sync"
    else:
        total = sum(seconds.values())
        schedule = "colocated: rollout, weight sync, log-probs and training one after another"
    decode_rate = w.global_batch * w.response_len / seconds["rollout"]
    return StepTime(seconds, total, schedule, decode_rate, rates, assume)
