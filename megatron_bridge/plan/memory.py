"""Per-device memory of a layout: exact static terms, estimated dynamic ones.

Exact (for megatron's local spec, with the experts ``TrainParallel.grouped_gemm`` picks; the TE
spec has the same tensors in a slightly different order, its grouped experts one parameter per
expert, which moves only the alignment padding): bf16 weights, fp32 main gradients and the distributed
optimizer's fp32 main parameters and Adam moments, reproducing megatron-core 0.12.1's buffer layout
(``_ParamAndGradBuffer``: reverse parameter order, 64-element alignment, buckets padded to
lcm(DP, 128)) and its sharding: dense parameters over DP*CP, expert parameters (EP > 1) over the
expert-data-parallel group EDP = W / (ETP*EP*PP). These differ for MoE (facts §2, §5).

Estimated: activations (with and without full recompute), fp32 vocab-parallel logits, the expert
ids of routing capture and replay, the rollout engine's share. The formulas are stated where they are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_bridge.plan.batching import TokenBudget, rows_of
from megatron_bridge.plan.layout import Layout, TrainParallel
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.plan.platforms import PLATFORMS
from megatron_bridge.plan.stages import layers_per_chunk

GIB = 1024**3
PARAM_BYTES = 2  # bf16 weights
GRAD_BYTES = 4  # fp32 main grads (grad_reduce_in_fp32)
MAIN_PARAM_BYTES = 4  # fp32 master copy of a bf16 parameter
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps a 0-dim fp32 step tensor per parameter (shard)


@dataclass(frozen=True)
class Param:
    numel: int
    expert: bool  # lives in megatron's expert-parallel buffer (EP > 1), sharded over EDP


def _layer_params(spec: ModelSpec, t: TrainParallel) -> list[Param]:
    """One decoder layer on one rank, in ``named_parameters()`` order of the local spec. The local
    experts are ``GroupedExperts`` (each projection of all of them one stacked parameter) with
    ``grouped_gemm``, else ``SequentialMLP`` (two parameters per expert)."""
    h, tp, etp = spec.hidden_size, t.tp, t.expert_tp
    experts_in_own_buffer = t.ep > 1
    local_experts = spec.num_experts // t.ep
    params = [
        Param(h, False),  # input_layernorm
        Param(h * spec.q_dim // tp, False),  # self_attention.linear_proj
        Param((spec.q_dim + 2 * spec.kv_dim) // tp * h, False),  # self_attention.linear_qkv
        Param(spec.head_dim, False),  # q_layernorm
        Param(spec.head_dim, False),  # k_layernorm
        Param(h, False),  # pre_mlp_layernorm
        Param(spec.num_experts * h, False),  # mlp.router
    ]
    fc1, fc2 = 2 * spec.moe_ffn_hidden_size // etp * h, h * spec.moe_ffn_hidden_size // etp
    if t.grouped_gemm:  # fc1_weight, fc2_weight
        return params + [Param(local_experts * n, experts_in_own_buffer) for n in (fc1, fc2)]
    return params + [Param(n, experts_in_own_buffer) for n in (fc1, fc2)] * local_experts  # linear_fc1, linear_fc2


def chunk_params(spec: ModelSpec, t: TrainParallel, pp_rank: int, vp_rank: int) -> list[Param]:
    """Parameters of one model chunk on one rank, in ``named_parameters()`` order."""
    layers = layers_per_chunk(spec.num_layers, t)[pp_rank][vp_rank]
    first = pp_rank == 0 and vp_rank == 0
    last = pp_rank == t.pp - 1 and vp_rank == (t.vpp or 1) - 1
    vocab_shard = spec.vocab_size // t.tp * spec.hidden_size
    params = [Param(vocab_shard, False)] if first else []
    params += _layer_params(spec, t) * layers
    if last:
        params.append(Param(spec.hidden_size, False))  # final_layernorm
        if not (spec.tie_word_embeddings and t.pp == 1):
            params.append(Param(vocab_shard, False))  # output_layer
    return params


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


@dataclass(frozen=True)
class Buffer:
    """megatron's ``_ParamAndGradBuffer`` layout: total size and each parameter's range."""

    numel: int
    ranges: list[tuple[int, int]]
    buckets: list[tuple[int, int]]


def buffer_layout(numels: list[int], dp: int, distributed_optimizer: bool, bucket_size: int | None = None) -> Buffer:
    """Where each parameter sits in a grad buffer (mirrors _ParamAndGradBuffer.__init__)."""

    def pad_bucket(i: int) -> int:
        return _pad(i, math.lcm(dp, 128)) if distributed_optimizer else i

    ranges: list[tuple[int, int]] = []
    buckets: list[tuple[int, int]] = []
    start = bucket_start = end = 0
    open_bucket = False
    for n in reversed(numels):  # megatron fills buffers in reverse (backprop) order
        if distributed_optimizer:
            start = _pad(start, 64)
        end = start + n
        ranges.append((start, end))
        open_bucket = True
        if bucket_size is not None and end - bucket_start >= bucket_size:
            closed = pad_bucket(end)
            buckets.append((bucket_start, closed))
            bucket_start = start = closed
            open_bucket = False
        else:
            start = end
    if open_bucket:
        buckets.append((bucket_start, pad_bucket(end)))
    return Buffer(numel=buckets[-1][1] if buckets else 0, ranges=ranges, buckets=buckets)


def shard_numel(buffer: Buffer, dp: int, dp_rank: int) -> int:
    """Parameter elements in one DP rank's optimizer shard (each bucket split in dp equal parts)."""
    total = 0
    for b_start, b_end in buffer.buckets:
        size = (b_end - b_start) // dp
        lo, hi = b_start + dp_rank * size, b_start + (dp_rank + 1) * size
        total += sum(max(0, min(e, hi) - max(s, lo)) for s, e in buffer.ranges)
    return total


def shard_param_count(buffer: Buffer, dp: int, dp_rank: int) -> int:
    """Parameters with a non-empty slice in one DP rank's shard (one optimizer state entry each)."""
    count = 0
    for b_start, b_end in buffer.buckets:
        size = (b_end - b_start) // dp
        lo, hi = b_start + dp_rank * size, b_start + (dp_rank + 1) * size
        count += sum(1 for s, e in buffer.ranges if min(e, hi) > max(s, lo))
    return count


@dataclass(frozen=True)
class StaticMemory:
    """Bytes on one rank, per term."""

    weights: int
    grads: int
    optimizer: int
    main_params: int = 0  # the fp32 main parameters' part of ``optimizer``

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def kept_during_rollout(static: StaticMemory, t: TrainParallel, reference: int = 0) -> int:
    """What stays on the device while the rollout engine generates: the terms whose offload flag
    is off. ``megatron_bridge.runtime.offload`` frees exactly these terms' storages (tested to the
    byte): weights and optimizer state are copied to the host, grads are freed and come back zeroed.
    ``reference``: the reference model's weights, under ``param_offload`` too."""
    return ((0 if t.param_offload else static.weights + reference) + (0 if t.grad_offload else static.grads)
            + (0 if t.optimizer_offload else static.optimizer))


def offload_host_bytes(static: StaticMemory, t: TrainParallel, reference: int = 0) -> int:
    """Host memory (pinned, kept between steps) the offload copies this device's state into:
    weights (the reference model's too) and optimizer state; grads are not copied."""
    return (static.weights + reference if t.param_offload else 0) + (static.optimizer if t.optimizer_offload else 0)


def data_parallel_sizes(layout: Layout) -> tuple[int, int]:
    """(DP*CP, EDP): the groups dense and expert optimizer states are sharded over."""
    t, w = layout.train, layout.cluster.world_size
    return w // (t.tp * t.pp), w // (t.expert_tp * t.ep * t.pp)


def static_memory(spec: ModelSpec, layout: Layout, pp_rank: int, dp_rank: int | None = None,
                  edp_rank: int | None = None) -> StaticMemory:
    """Weights, grads and optimizer states of a rank on pipeline stage ``pp_rank``. Without DP
    ranks, the worst rank of the stage (shards differ by the alignment padding)."""
    t = layout.train
    dp, edp = data_parallel_sizes(layout)
    weights = grads = optimizer = main_params = 0
    for vp_rank in range(t.vpp or 1):
        params = chunk_params(spec, t, pp_rank, vp_rank)
        for expert, size, rank in ((False, dp, dp_rank), (True, edp, edp_rank)):
            numels = [p.numel for p in params if p.expert == expert]
            if not numels:
                continue
            if not t.use_distributed_optimizer:
                n = sum(numels)
                weights += n * PARAM_BYTES
                grads += n * GRAD_BYTES
                optimizer += n * (MAIN_PARAM_BYTES + ADAM_BYTES) + len(numels) * ADAM_STEP_BYTES
                main_params += n * MAIN_PARAM_BYTES
                continue
            buf = buffer_layout(numels, size, distributed_optimizer=True)
            weights += buf.numel * PARAM_BYTES  # the distributed optimizer re-homes params in a padded buffer
            grads += buf.numel * GRAD_BYTES
            ranks = range(size) if rank is None else [rank]
            optimizer += max(
                shard_numel(buf, size, r) * (MAIN_PARAM_BYTES + ADAM_BYTES)
                + shard_param_count(buf, size, r) * ADAM_STEP_BYTES
                for r in ranks
            )
            main_params += max(shard_numel(buf, size, r) for r in ranks) * MAIN_PARAM_BYTES
    return StaticMemory(weights, grads, optimizer, main_params)


def checkpoint_bytes(spec: ModelSpec, world_size: int, weight_bytes: int = PARAM_BYTES) -> tuple[int, int]:
    """A checkpoint's tensor bytes (``megatron_bridge.runtime.checkpoint``), in total and per rank.
    Every parameter is stored once as the model's weight and once in the optimizer's fp32 main copy
    and Adam moments, in the model's space, whatever the layout. The fully parallel save spreads
    the writing over all ranks (a shard replicated over DP is written by one of its replicas,
    balanced by size), so a rank writes about the total over the world size. Not counted:
    torch.save's framing of each stored tensor slice (1.6 KB each on the tiny model) and the
    non-tensor state (schedule, RNG states, metadata: kilobytes per rank)."""
    total = spec.total_params * (weight_bytes + MAIN_PARAM_BYTES + ADAM_BYTES)
    return total, math.ceil(total / world_size)


# ---- estimates -----------------------------------------------------------------------------


def activation_bytes_per_layer(spec: ModelSpec, t: TrainParallel, seq_len: int, micro_batch_size: int = 1,
                               gathered_kv: bool = False) -> int:
    """ESTIMATE of what one layer keeps for backward for one micro-batch of ``micro_batch_size``
    sequences of ``seq_len`` tokens, bf16, sequence parallel: each rank holds tokens/(TP*CP) of the
    sequence. Attention: ln input, qkv input, q/k/v, core output, proj input; besides, the fused
    kernel keeps one fp32 log-sum-exp per head and local query token (seq_len/CP of them), megatron's
    DotProductAttention (``use_flash_attn=false``, never with CP) 6 bytes a score of every head's
    [s, s]: the fp32 softmax (autograd's, for its backward; ``attention_softmax_in_fp32``) and its
    bf16 copy (the PV product's). ``gathered_kv``: the context-parallel attention off the NPU
    all-gathers K and V over the CP ranks and the fused kernel keeps its inputs, the whole
    sequence's K and V instead of the local ones (MindSpeed's ring on the NPU passes the local ones
    round). MoE: ln input, router input, fp32 router logits, and per routed copy (top-k) the
    permuted input, fc1 output (2I/ETP), activation (I/ETP) and fc2 output."""
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.moe_ffn_hidden_size // t.expert_tp
    tokens = seq_len * micro_batch_size
    local = tokens / (t.tp * t.cp)
    heads = spec.num_attention_heads / t.tp
    attention = 2 * (2 * h + 3 * q + 2 * kv)
    moe = 2 * (2 * h + spec.moe_topk * (2 * h + 3 * i)) + 4 * spec.num_experts
    core = tokens / t.cp * heads * 4 if t.flash_attn else micro_batch_size * heads * seq_len**2 * 6
    gathered = local * (t.cp - 1) * 2 * 2 * kv if gathered_kv else 0  # the other CP ranks' K and V, bf16
    return int(local * (attention + moe) + core + gathered)


def attention_working_bytes(spec: ModelSpec, t: TrainParallel, seq_len: int, micro_batch_size: int = 1) -> int:
    """ESTIMATE of what one layer's attention holds while it computes, beyond what it keeps: the
    fused kernel works in tiles (nothing worth counting); megatron's DotProductAttention 12 bytes a
    score in backward (its forward needs less): the bf16 scores' buffer it keeps for the process
    (``get_global_memory_buffer``), the bf16 and fp32 gradients of the probabilities and the
    softmax's fp32 input gradient. With the 6 kept, the slice of docs/bench_device.md at 8k tokens
    needs at least 24 bytes a score: an H100 80GB ran out there."""
    return 0 if t.flash_attn else int(micro_batch_size * spec.num_attention_heads / t.tp * seq_len**2 * 12)


def in_flight_microbatches(t: TrainParallel) -> float:
    """Micro-batches whose activations the first stage holds at the 1F1B peak (PP), times
    megatron's interleaving penalty 1 + (PP-1)/(PP*VPP)."""
    if t.vpp:
        return t.pp * (1 + (t.pp - 1) / (t.pp * t.vpp))
    return float(t.pp)


def activation_memory(spec: ModelSpec, t: TrainParallel, layers: int, seq_len: int, micro_batch_size: int = 1,
                      gathered_kv: bool = False) -> int:
    """ESTIMATE of the peak activations of a stage with ``layers`` layers: what the micro-batches in
    flight keep, and one layer's attention at work."""
    per_layer = activation_bytes_per_layer(spec, t, seq_len, micro_batch_size, gathered_kv)
    working = attention_working_bytes(spec, t, seq_len, micro_batch_size)
    if t.recompute_granularity == "full":
        # Only each layer's input is kept; one recompute group is rebuilt at a time in backward.
        kept = layers * 2 * spec.hidden_size * seq_len * micro_batch_size / (t.tp * t.cp)
        rebuilt = per_layer * min(t.recompute_num_layers or 1, layers)
        return int(kept * in_flight_microbatches(t) + rebuilt + working)
    return int(layers * per_layer * in_flight_microbatches(t) + working)


def routing_memory(spec: ModelSpec, t: TrainParallel, layers: int, tokens: int) -> int:
    """What routing capture and replay keep on the device: each layer's k expert ids (int64) per
    local token of the micro-batches in flight (replay keeps them for the recompute in backward;
    capture moves them to the host after each micro-batch)."""
    return int(layers * tokens / (t.tp * t.cp) * spec.moe_topk * 8 * in_flight_microbatches(t))


# The chunking of the log-prob and entropy pass (loss.vocab_parallel's DEFAULT_CHUNK_SIZE and
# CHUNKS_AT_LEAST; the planner imports no torch, a test keeps the two equal).
LOG_PROB_CHUNK_TOKENS = 1024
LOG_PROB_CHUNKS_AT_LEAST = 16


def logits_memory(spec: ModelSpec, t: TrainParallel, seq_len: int, micro_batch_size: int = 1, packed: bool = True,
                  log_prob_chunk_size: int = LOG_PROB_CHUNK_TOKENS) -> int:
    """ESTIMATE for the last stage: the micro-batch's bf16 vocab-parallel logits [tokens, V/TP] (held
    twice for a moment when several padded rows come out of megatron's GPTModel, which transposes
    them to [b, s] with a copy; one row, or a packed micro-batch, is in that order already) and the
    chunk the log-prob and entropy pass holds in float32 (``loss.vocab_parallel``): 6 bytes per
    element of min(``log_prob_chunk_size``, tokens / 16) rows, every row with chunk size 0. The
    gradient is written into the logits' own storage."""
    tokens = seq_len * micro_batch_size / t.cp
    vocab = spec.vocab_size / t.tp
    copies = 2 if micro_batch_size > 1 and not packed else 1
    rows = tokens if log_prob_chunk_size == 0 else min(log_prob_chunk_size, math.ceil(tokens / LOG_PROB_CHUNKS_AT_LEAST))
    return int(tokens * vocab * 2 * copies + rows * vocab * 6)


def log_prob_pass_memory(spec: ModelSpec, t: TrainParallel, seq_len: int, rows: float, packed: bool = True,
                         log_prob_chunk_size: int = LOG_PROB_CHUNK_TOKENS, gathered_kv: bool = False) -> int:
    """ESTIMATE for the last stage of a forward-only log-prob pass (the old policy's, the
    reference's) of ``rows`` sequences: its logits and log-prob chunk, and one layer at work (what the
    layer would keep for backward: more than its forward holds at once). Nothing is kept for
    backward, so a log-prob micro-batch of the training one's size needs less than training; a
    larger one (verl scripts often give the log-prob passes 1.5-2x the actor's token budget) can
    need more, mostly for its logits."""
    return (logits_memory(spec, t, seq_len, rows, packed, log_prob_chunk_size)
            + activation_bytes_per_layer(spec, t, seq_len, rows, gathered_kv))


def longest_sequence(spec: ModelSpec, layout: Layout, micro_batch: float | TokenBudget = 1, reference: bool = False,
                     packed: bool = True, log_prob_chunk_size: int = LOG_PROB_CHUNK_TOKENS,
                     log_prob: float | TokenBudget | None = None) -> int | None:
    """The longest sequence whose training peak fits the device (``estimate``), in tokens, a length
    the layout can split (a multiple of ``TrainParallel.seq_multiple``: lcm(2*CP, CP*TP) with CP and
    sequence parallel); 0 when none does, None when the device memory is not known. Where the
    training micro-batch (``micro_batch``) is a token budget, it is as many such sequences as the
    budget holds, and none longer than it holds; likewise the log-prob passes' micro-batch
    (``log_prob``: rows or a budget) where it is given."""
    if not layout.cluster.device_memory_gb:
        return None
    budgets = [b for b in (micro_batch, log_prob) if isinstance(b, TokenBudget)]

    def fits(seq_len: int) -> bool:
        if not all(b.holds(layout.train, seq_len) for b in budgets):
            return False
        log_prob_rows = None if log_prob is None else rows_of(log_prob, layout, seq_len)
        return estimate(spec, layout, seq_len, rows_of(micro_batch, layout, seq_len), reference, packed,
                        log_prob_chunk_size, log_prob_rows).train_fits

    step = layout.train.seq_multiple
    if not fits(step):
        return 0
    low, high = 1, 2  # in steps: fits(low * step), and find a high that does not
    while fits(high * step):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle)
    return low * step


def rollout_weight_bytes(spec: ModelSpec, layout: Layout) -> int:
    """bf16 rollout weights per device: dense parts over rollout TP, experts over TP*DP (vLLM
    shards MoE over TP*DP with or without expert parallel)."""
    r = layout.rollout
    experts = spec.num_layers * spec.num_experts * spec.expert_params
    dense = spec.total_params - experts
    return int(2 * (dense / r.tp + experts / (r.tp * r.dp)))


def hf_engine_bytes(spec: ModelSpec, dtype_bytes: int, rows: int, max_len: int) -> int:
    """The transformers rollout engine on one device (an estimate): every weight (it does not
    shard), the KV cache of ``rows`` sequences of ``max_len`` tokens (a left-padded batch keeps
    every row as long as the longest), and the float32 logits of one decoding step with about
    three more of that size for sampling (temperature, top-k / top-p, softmax)."""
    kv_cache = 2 * spec.num_layers * spec.kv_dim * rows * max_len * dtype_bytes
    sampling = 4 * rows * spec.vocab_size * 4
    return spec.total_params * dtype_bytes + kv_cache + sampling


@dataclass(frozen=True)
class RolloutPoolMemory:
    """Per device of the rollout's own pool (``hybrid_engine=false``): the engine alone, no
    training state. vLLM takes ``gpu_memory_utilization`` of the device (the share) for its weights,
    then its KV cache (and its activations) in what the share leaves."""

    weights: int
    share: int | None  # None: the device memory is not known

    @property
    def kv_cache(self) -> int | None:
        return None if self.share is None else self.share - self.weights

    @property
    def fits(self) -> bool | None:
        return None if self.share is None else self.weights < self.share


@dataclass
class MemoryReport:
    """Worst pipeline stage's memory per device, in bytes; ``exact`` marks the exact terms."""

    pp_rank: int
    static: StaticMemory
    activations: int
    logits: int
    routing: int
    log_prob_pass: int  # a forward-only log-prob pass's working memory (logits, one layer at work), if counted
    device_bytes: int | None
    rollout_share: int | None
    rollout_weights: int
    resident_during_rollout: int
    offload_host: int
    reference: int = 0  # the reference model's weights (KL loss or KL in reward); it has no grads or optimizer
    checkpoint_total: int = 0  # a checkpoint's bytes (checkpoint_bytes)
    checkpoint_per_rank: int = 0
    terms: list[tuple[str, int, bool]] = field(default_factory=list)
    rollout_pool: RolloutPoolMemory | None = None  # the rollout's own devices; None: colocated
    optimizer_step: int = 0  # the optimizer step's temporaries, after the activations are freed

    @property
    def train_peak(self) -> int:
        return self.static.total + self.reference + max(self.activations + self.logits + self.routing,
                                                        self.log_prob_pass, self.optimizer_step)

    @property
    def train_fits(self) -> bool | None:
        return None if self.device_bytes is None else self.train_peak <= self.device_bytes

    @property
    def rollout_fits(self) -> bool | None:
        if self.rollout_pool is not None:
            return self.rollout_pool.fits
        if self.device_bytes is None:
            return None
        return (self.resident_during_rollout + self.rollout_share <= self.device_bytes
                and self.rollout_weights < self.rollout_share)

    @property
    def fits(self) -> bool | None:
        if self.device_bytes is None:
            return None
        return bool(self.train_fits and self.rollout_fits)


def estimate(spec: ModelSpec, layout: Layout, seq_len: int, micro_batch_size: float = 1,
             reference: bool = False, packed: bool = True,
             log_prob_chunk_size: int = LOG_PROB_CHUNK_TOKENS, log_prob_rows: float | None = None) -> MemoryReport:
    """Memory per device on the worst pipeline stage of a validated layout; with ``reference``, a
    reference model in the same layout (its weights buffer is the actor's). ``packed`` and
    ``log_prob_chunk_size``: the actor's ``use_remove_padding`` and ``log_prob_chunk_size``.
    ``log_prob_rows``: the log-prob passes' micro-batch where it differs from the training one (at
    the same rows a forward-only pass needs less)."""
    t, cl, r = layout.train, layout.cluster, layout.rollout
    tokens = seq_len * micro_batch_size
    device = int(cl.device_memory_gb * GIB) if cl.device_memory_gb else None
    chunks = layers_per_chunk(spec.num_layers, t)
    gathered_kv = t.cp > 1 and cl.device != "npu"  # the package's CP attention all-gathers K and V
    reports = []
    for pp_rank in range(t.pp):
        static = static_memory(spec, layout, pp_rank)
        acts = activation_memory(spec, t, sum(chunks[pp_rank]), seq_len, micro_batch_size, gathered_kv)
        routing = routing_memory(spec, t, sum(chunks[pp_rank]), tokens)
        last = pp_rank == t.pp - 1
        logits = logits_memory(spec, t, seq_len, micro_batch_size, packed, log_prob_chunk_size) if last else 0
        log_prob = (log_prob_pass_memory(spec, t, seq_len, log_prob_rows, packed, log_prob_chunk_size, gathered_kv)
                    if last and log_prob_rows is not None else 0)
        ref = static.weights if reference else 0
        reports.append(MemoryReport(
            pp_rank=pp_rank, static=static, activations=acts, logits=logits, routing=routing, log_prob_pass=log_prob,
            device_bytes=device,
            rollout_share=int(r.gpu_memory_utilization * device) if device else None,
            rollout_weights=rollout_weight_bytes(spec, layout),
            resident_during_rollout=kept_during_rollout(static, t, ref), offload_host=offload_host_bytes(static, t, ref),
            # a multi-tensor Adam (torch's foreach path) takes sqrt(exp_avg_sq) of the whole shard at
            # once: 4 B per main parameter (7.0 GiB for 1.87 B on an H100, docs/kernels.md); a fused
            # Adam makes none. On the NPU (MindSpeed's optimizer, unmeasured) an upper bound.
            reference=ref, optimizer_step=0 if PLATFORMS[cl.device].fused_adam else static.main_params,
        ))
    worst = max(reports, key=lambda m: m.train_peak)
    if layout.separate_rollout:  # the engine's share of a rollout device, the same kind of device
        worst.rollout_pool = RolloutPoolMemory(worst.rollout_weights, worst.rollout_share)
    worst.checkpoint_total, worst.checkpoint_per_rank = checkpoint_bytes(spec, cl.world_size)
    worst.terms = [
        ("weights (bf16)", worst.static.weights, True),
        ("grads (fp32 main grads)", worst.static.grads, True),
        ("optimizer (fp32 master + Adam m, v)", worst.static.optimizer, True),
        *([("reference model weights (bf16, KL)", worst.reference, True)] if reference else []),
        ("activations" + (" (full recompute)" if t.recompute_granularity == "full" else ""), worst.activations, False),
        ("logits (bf16) + log-prob chunk (fp32)", worst.logits, False),
        ("routing ids (capture, replay)", worst.routing, False),
        *([("optimizer step (if above the 3 before)", worst.optimizer_step, False)] if worst.optimizer_step else []),
        *([("log-prob forward (if above those 3)", worst.log_prob_pass, False)] if worst.log_prob_pass else []),
    ]
    return worst
