"""Check a parallel layout against the model and the cluster before any process starts.

``validate`` returns every violated rule (not only the first), each naming the rule, the values
and the valid choices. The rules are megatron-core 0.12.1's and vLLM / vLLM-Ascend's, with their
sources in docs/sources.md (parallelism rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from megatron_bridge.plan.layout import Layout
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.plan.stages import layers_per_stage


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


@dataclass(frozen=True)
class Context:
    spec: ModelSpec
    layout: Layout
    seq_len: int


def _choices(values: Iterable[int]) -> str:
    values = list(values)
    return ", ".join(str(v) for v in values) if values else "none"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


Rule = Callable[[Context], Iterable[Violation]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def _train_tp_ok(spec: ModelSpec, tp: int) -> bool:
    return spec.num_attention_heads % tp == 0 and spec.num_query_groups % tp == 0 and spec.vocab_size % tp == 0


# ---- training: tensor parallel -------------------------------------------------------------


@rule
def tp_divides_heads_and_groups(c: Context):
    s, tp = c.spec, c.layout.train.tp
    valid = _choices(t for t in divisors(c.layout.cluster.world_size) if _train_tp_ok(s, t))
    for what, n in (("num_attention_heads", s.num_attention_heads), ("num_query_groups", s.num_query_groups)):
        if n % tp:
            yield Violation(
                "train.tp_divides_" + what,
                f"tensor_model_parallel_size={tp}: {what} ({n}) must be a multiple of it; "
                f"valid TP for this model: {valid}",
            )
    if s.vocab_size % tp:
        yield Violation(
            "train.tp_divides_vocab",
            f"tensor_model_parallel_size={tp}: vocab_size ({s.vocab_size}) must be divisible by it "
            f"(vocab-parallel embedding and logits); valid TP for this model: {valid}",
        )


@rule
def sequence_parallel(c: Context):
    t = c.layout.train
    if t.sequence_parallel and t.tp == 1:
        yield Violation(
            "train.sp_needs_tp",
            "sequence_parallel=true needs tensor_model_parallel_size > 1; set sequence_parallel: false",
        )
    if t.tp > 1 and not t.sequence_parallel:
        yield Violation(
            "train.moe_tp_needs_sp",
            f"tensor_model_parallel_size={t.tp} on an MoE model needs sequence_parallel: true "
            "(megatron-core refuses to train MoE with TP > 1 without it)",
        )


# ---- training: world size ------------------------------------------------------------------


@rule
def world_divisibility(c: Context):
    t, w = c.layout.train, c.layout.cluster.world_size
    dense = t.tp * t.pp * t.cp
    if w % dense:
        valid = _choices(d for d in divisors(w) if w % (d * t.tp * t.cp) == 0)
        yield Violation(
            "train.world_divisible_by_tp_pp_cp",
            f"world size {w} (nodes x devices) must be divisible by TP*PP*CP = {t.tp}*{t.pp}*{t.cp} = {dense}; "
            f"with TP={t.tp}, CP={t.cp} valid PP: {valid}",
        )
    expert = t.expert_tp * t.ep * t.pp
    if w % expert:
        valid = _choices(e for e in divisors(w) if w % (t.expert_tp * e * t.pp) == 0 and c.spec.num_experts % e == 0)
        yield Violation(
            "train.world_divisible_by_etp_ep_pp",
            f"world size {w} must be divisible by ETP*EP*PP = {t.expert_tp}*{t.ep}*{t.pp} = {expert}; "
            f"with ETP={t.expert_tp}, PP={t.pp} valid EP: {valid}",
        )


# ---- training: experts ---------------------------------------------------------------------


@rule
def experts(c: Context):
    s, t = c.spec, c.layout.train
    if s.num_experts % t.ep:
        yield Violation(
            "train.ep_divides_experts",
            f"expert_model_parallel_size={t.ep}: num_experts ({s.num_experts}) must be divisible by it; "
            f"valid EP: {_choices(divisors(s.num_experts))}",
        )
    if s.moe_ffn_hidden_size % t.expert_tp:
        yield Violation(
            "train.etp_divides_moe_ffn",
            f"expert_tensor_parallel_size={t.expert_tp}: moe_intermediate_size ({s.moe_ffn_hidden_size}) must be "
            f"divisible by it; valid ETP: {_choices(divisors(s.moe_ffn_hidden_size)[:8])}",
        )
    if t.ep == 1 and t.expert_tp != t.tp:
        # megatron-core 0.12.1, tensor_parallel/layers.py (Column/RowParallelLinear.__init__): an
        # expert linear takes the expert path (explicit_expert_comm, weights marked allreduce=False,
        # which DistributedDataParallel reduces over the expert data-parallel group) only with EP > 1
        # or ETP > 1; RowParallelLinear.forward otherwise reduce-scatters over the TP group.
        w = c.layout.cluster.world_size
        valid_ep = [e for e in divisors(s.num_experts) if e > 1 and w % (t.expert_tp * e * t.pp) == 0]
        crash = (" and the first forward fails ('First dimension of the tensor should be divisible by tensor "
                 "parallel size': the expert output is reduce-scattered over the TP group)") if t.expert_tp == 1 else ""
        keep = f", or keep ETP={t.expert_tp} with expert_model_parallel_size in: {_choices(valid_ep)}" if valid_ep else ""
        yield Violation(
            "train.etp_equals_tp_without_ep",
            f"expert_tensor_parallel_size={t.expert_tp} with expert_model_parallel_size=1: megatron-core 0.12.1 "
            f"treats the experts as dense layers when EP=1, so ETP must equal TP ({t.tp}); otherwise their "
            f"gradients are reduced over the dense data-parallel group, not the expert one (a wrong update){crash}; "
            f"set expert_tensor_parallel_size: {t.tp}{keep}",
        )


# ---- training: pipeline --------------------------------------------------------------------


@rule
def pipeline_layers(c: Context):
    t, n = c.layout.train, c.spec.num_layers
    uneven = t.first_stage_layers is not None or t.last_stage_layers is not None
    if t.vpp is not None and (t.pp == 1 or t.vpp < 2):
        yield Violation(
            "train.vpp_needs_pp",
            f"virtual_pipeline_model_parallel_size={t.vpp} needs pipeline_model_parallel_size > 1 and a value >= 2 "
            "(the interleaved schedule); remove it or raise PP",
        )
        return
    vpp = t.vpp or 1
    if not uneven:
        slots = n + t.account_for_embedding_in_pipeline_split + t.account_for_loss_in_pipeline_split
        if slots % t.pp:
            even = [p for p in divisors(slots)]
            yield Violation(
                "train.pp_divides_layers",
                f"pipeline_model_parallel_size={t.pp}: {slots} layers"
                + (" (embedding/loss counted)" if slots != n else "")
                + f" must be divisible by it; valid even PP: {_choices(even)}; or set "
                "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage for an uneven split",
            )
        elif (slots // t.pp) % vpp:
            yield Violation(
                "train.vpp_divides_stage_layers",
                f"virtual_pipeline_model_parallel_size={vpp}: layers per pipeline rank ({slots // t.pp}) must be "
                f"divisible by it; valid VPP: {_choices(d for d in divisors(slots // t.pp) if d > 1)}",
            )
        return
    if t.pp == 1:
        yield Violation(
            "train.uneven_pp_needs_pp",
            "num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1",
        )
        return
    if t.account_for_embedding_in_pipeline_split or t.account_for_loss_in_pipeline_split:
        yield Violation(
            "train.uneven_pp_not_with_accounting",
            "num_layers_in_first/last_pipeline_stage cannot be combined with "
            "account_for_embedding/loss_in_pipeline_split; use one or the other",
        )
        return
    first, last = t.first_stage_layers or 0, t.last_stage_layers or 0
    middle_stages = t.pp - (t.first_stage_layers is not None) - (t.last_stage_layers is not None)
    middle = n - first - last
    for name, value in (("first", t.first_stage_layers), ("last", t.last_stage_layers)):
        if value is not None and value % vpp:
            yield Violation(
                "train.uneven_pp_vpp",
                f"num_layers_in_{name}_pipeline_stage={value} must be divisible by "
                f"virtual_pipeline_model_parallel_size={vpp}",
            )
    if middle_stages == 0:
        # megatron-core 0.12.1 TransformerConfig.__post_init__ takes `layers % (PP - 2)` for the
        # stages between first and last: ZeroDivisionError when there are none.
        yield Violation(
            "train.uneven_pp_needs_middle_stage",
            f"num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage are both set with "
            f"pipeline_model_parallel_size={t.pp}: megatron-core 0.12.1 needs at least one stage between them "
            f"(it divides the other layers by PP-2 = 0 stages); set only one of them, or PP >= 3",
        )
        return
    if middle <= 0 or middle % middle_stages:
        options = []
        stages = t.pp - 1 - (t.last_stage_layers is not None)  # middle stages once the first is set
        for f in range(1, n):
            rest = n - f - last
            if stages and rest > 0 and rest % stages == 0 and f % vpp == 0 and (rest // stages) % vpp == 0:
                options.append(f)
        yield Violation(
            "train.uneven_pp_layers",
            f"uneven pipeline: {n} layers - first {first} - last {last} = {middle} must split evenly, "
            f"at least one layer each, over the {middle_stages} middle stage(s) of PP={t.pp}; with this last-stage "
            f"value valid first-stage values: {_choices(options[:12])}",
        )
    elif (middle // middle_stages) % vpp:
        yield Violation(
            "train.uneven_pp_vpp",
            f"layers per middle pipeline rank ({middle // middle_stages}) must be divisible by "
            f"virtual_pipeline_model_parallel_size={vpp}",
        )


@rule
def interleaved_last_stage(c: Context):
    t, n = c.layout.train, c.spec.num_layers
    if not (t.vpp and t.pp > 1 and t.last_stage_layers is not None and t.first_stage_layers is None):
        return
    # megatron-core 0.12.1 transformer_layer.py get_transformer_layer_offset, interleaved uneven
    # branch: ranks > 0 are offset by (pipeline_rank - 1) middle stages even when rank 0 is a
    # middle stage itself (no uneven first stage).
    rest = n - t.last_stage_layers
    if t.pp == 2:
        fix = f"use num_layers_in_first_pipeline_stage: {rest} instead (the same split)"
    elif rest > 0 and rest % (t.pp - 1) == 0:
        fix = f"set num_layers_in_first_pipeline_stage: {rest // (t.pp - 1)} too (the same split)"
    else:
        fix = "set num_layers_in_first_pipeline_stage too"
    yield Violation(
        "train.uneven_pp_vpp_last_needs_first",
        f"num_layers_in_last_pipeline_stage={t.last_stage_layers} with virtual_pipeline_model_parallel_size={t.vpp} "
        "and no num_layers_in_first_pipeline_stage: megatron-core 0.12.1 then numbers the layers of pipeline ranks "
        "> 0 as if rank 0 were an uneven first stage, so two ranks build the same layers and others are never "
        f"built (wrong log-probs, no error); {fix}",
    )


# ---- training: sequence split, context parallel, recompute -----------------------------------


@rule
def sequence_split(c: Context):
    t = c.layout.train
    multiple = t.seq_multiple
    if c.seq_len % multiple == 0:
        return
    # megatron-core 0.12.1: utils.py get_batch_on_this_cp_rank views each sequence as 2*CP chunks,
    # rank r keeping chunks r and 2CP-1-r (rotary positions likewise: rope_utils.py
    # get_pos_emb_on_this_cp_rank); sequence parallel scatters each rank's seq_len/CP over TP
    # (tensor_parallel/mappings.py: "First dimension of the tensor should be divisible by tensor
    # parallel size"). MindSpeed's algorithms: TrainParallel.seq_multiple.
    why = []
    if t.cp > 1 and t.cp_algo == "megatron_cp_algo":
        why.append(f"context parallel cuts each sequence into 2*CP = {2 * t.cp} chunks (CP rank r holds chunks r "
                   f"and {2 * t.cp - 1}-r)")
    elif t.cp > 1 and t.cp_algo == "hybrid_cp_algo":
        why.append(f"hybrid_cp_algo needs 2*CP = {2 * t.cp} (MindSpeed's check: each ring rank holds two of 2 x ring "
                   "degree chunks, cut again over its Ulysses ranks)")
    elif t.cp > 1:
        why.append(f"{t.cp_algo} cuts each sequence into CP = {t.cp} contiguous slices")
    if t.sequence_parallel and t.tp > 1:
        why.append(f"sequence parallel splits each rank's seq_len/CP over tensor_model_parallel_size={t.tp}")
    padded = -(-c.seq_len // multiple) * multiple
    yield Violation(
        "train.seq_len_divisible",
        f"seq_len={c.seq_len} must be a multiple of {multiple}: " + "; ".join(why)
        + f"; pad sequences to a multiple of {multiple} (e.g. {padded})",
    )


@rule
def context_parallel(c: Context):
    s, t, device = c.spec, c.layout.train, c.layout.cluster.device
    if t.cp > 1 and not t.flash_attn:
        # megatron-core 0.12.1 transformer/dot_product_attention.py DotProductAttention.__init__:
        # assert self.config.context_parallel_size == 1, "Context parallelism is only supported by
        # TEDotProductAttention!"; MindSpeed's CP algorithms are its flash attention (their
        # validate_args set use_flash_attn = True).
        yield Violation(
            "train.cp_needs_flash_attn",
            f"context_parallel_size={t.cp} with use_flash_attn=false: megatron-core 0.12.1's DotProductAttention "
            "asserts context_parallel_size == 1 ('Context parallelism is only supported by TEDotProductAttention!'); "
            "context-parallel attention is the fused one: set use_flash_attn: true",
        )
    if t.cp_algo != "megatron_cp_algo" and device != "npu":
        yield Violation(
            "train.cp_algo_needs_npu",
            f"context_parallel_algo={t.cp_algo} is MindSpeed's, on the NPU only; on {device} the context-parallel "
            "attention is the package's own (each CP rank holds megatron's load-balanced chunks r and 2CP-1-r, "
            "keys and values all-gathered over CP): set context_parallel_algo: megatron_cp_algo",
        )
    elif t.cp_algo in ("adaptive_cp_algo", "hybrid_adaptive_cp_algo"):
        # MindSpeed core/context_parallel/get_batch_utils.py: these take each rank's tokens from an
        # order computed from the attention mask (remapped_seq_order) in megatron.training's
        # get_batch_on_this_cp_rank, a data path this package does not use.
        yield Violation(
            "train.cp_algo_unsupported",
            f"context_parallel_algo={t.cp_algo}: MindSpeed's adaptive algorithms choose each CP rank's tokens from "
            "the attention mask inside megatron.training's data loader, which the actor does not use; choose "
            "megatron_cp_algo (ring), ulysses_cp_algo or hybrid_cp_algo",
        )
    if t.ulysses_degree_in_cp is not None and t.cp_algo != "hybrid_cp_algo":
        yield Violation(
            "train.ulysses_degree_needs_hybrid",
            f"ulysses_degree_in_cp={t.ulysses_degree_in_cp} is read by context_parallel_algo=hybrid_cp_algo only "
            f"(here {t.cp_algo}); remove it, or set context_parallel_algo: hybrid_cp_algo",
        )
    if t.cp == 1 or device != "npu":
        return
    ulysses = {"ulysses_cp_algo": t.cp, "hybrid_cp_algo": t.ulysses_degree_in_cp}.get(t.cp_algo)
    if t.cp_algo == "hybrid_cp_algo":
        # MindSpeed features_manager/context_parallel/context_parallel_feature.py validate_args (which
        # repatch does not run: checked here): ring degree CP / ulysses_degree_in_cp > 1, no remainder.
        valid = _choices(u for u in divisors(t.cp) if t.cp // u > 1)
        if ulysses is None or t.cp % ulysses or t.cp // ulysses < 2:
            got = "ulysses_degree_in_cp is not set" if ulysses is None else f"ulysses_degree_in_cp={ulysses}"
            yield Violation(
                "train.cp_hybrid_ulysses_degree",
                f"context_parallel_algo=hybrid_cp_algo with context_parallel_size={t.cp}: {got}; "
                f"it must divide CP and leave a ring of at least 2 (CP / it >= 2); valid: {valid}",
            )
            return
    if ulysses is None:
        return
    # Ulysses exchanges heads for sequence (all-to-all over its ranks): MindSpeed's validate_args
    # (ulysses_context_parallel.py, context_parallel_feature.py) need the attention heads divisible
    # by the Ulysses degree x TP; UlyssesContextAttention.forward (core/context_parallel/
    # ulysses_context_parallel/ulysses_context_parallel.py) repeats the key/value heads up to the
    # query heads only when the degree exceeds them, otherwise splits them over its ranks.
    hybrid = t.cp_algo == "hybrid_cp_algo"
    name = "ulysses_degree_in_cp" if hybrid else "context_parallel_size"
    if s.num_attention_heads % (ulysses * t.tp):
        fits = [u for u in divisors(s.num_attention_heads // t.tp) if u > 1 and (not hybrid or t.cp % u == 0 and u < t.cp)]
        yield Violation(
            "train.cp_ulysses_heads",
            f"{t.cp_algo}: num_attention_heads ({s.num_attention_heads}) must be divisible by {name} x "
            f"tensor_model_parallel_size = {ulysses}*{t.tp} (Ulysses gives each rank heads/({name}*TP)); with "
            f"TP={t.tp} valid {name}: {_choices(fits)}",
        )
    kv = s.num_query_groups // t.tp
    if ulysses <= kv and kv % ulysses:
        yield Violation(
            "train.cp_ulysses_kv_heads",
            f"{t.cp_algo}: the {kv} key/value heads per TP rank must be divisible by {name}={ulysses}, or fewer than "
            "it (MindSpeed then repeats them to the query heads); otherwise Ulysses splits them unevenly",
        )


@rule
def recompute(c: Context):
    t = c.layout.train
    g = t.recompute_granularity
    if g is None:
        return
    if g not in ("full", "selective"):
        yield Violation("train.recompute_granularity", f"recompute_granularity={g!r}; choose full, selective or null")
        return
    if g == "selective":
        if t.recompute_num_layers is not None:
            yield Violation(
                "train.recompute_selective",
                "recompute_num_layers must not be set with recompute_granularity: selective",
            )
        return
    if t.recompute_method not in ("uniform", "block"):
        yield Violation(
            "train.recompute_method",
            f"recompute_granularity: full needs recompute_method uniform or block, got {t.recompute_method!r}",
        )
    per_rank = min(layers_per_stage(c.spec.num_layers, t)) if not _pipeline_broken(c) else None
    if t.recompute_num_layers is None or (per_rank is not None and not 1 <= t.recompute_num_layers <= max(per_rank, 1)):
        yield Violation(
            "train.recompute_num_layers",
            f"recompute_granularity: full needs recompute_num_layers between 1 and the layers per pipeline rank"
            f" ({per_rank}); got {t.recompute_num_layers}",
        )


def _pipeline_broken(c: Context) -> bool:
    return any(True for _ in pipeline_layers(c))


# ---- rollout (vLLM / vLLM-Ascend) ----------------------------------------------------------


def rollout_kv_heads_ok(spec: ModelSpec, tp: int) -> bool:
    """vLLM shards KV heads when TP divides them and replicates them when TP is a multiple."""
    kv = spec.num_query_groups
    return kv % tp == 0 if tp <= kv else tp % kv == 0


def rollout_tp_ok(spec: ModelSpec, tp: int) -> bool:
    return spec.num_attention_heads % tp == 0 and rollout_kv_heads_ok(spec, tp)


@rule
def rollout(c: Context):
    s, r, w = c.spec, c.layout.rollout, c.layout.rollout_world_size
    valid_tp = [t for t in divisors(w) if rollout_tp_ok(s, t)]
    if s.num_attention_heads % r.tp:
        yield Violation(
            "rollout.tp_divides_heads",
            f"rollout tensor_model_parallel_size={r.tp}: num_attention_heads ({s.num_attention_heads}) must be "
            f"divisible by it; valid rollout TP: {_choices(valid_tp)}",
        )
    kv = s.num_query_groups
    if not rollout_kv_heads_ok(s, r.tp):
        yield Violation(
            "rollout.kv_heads",
            f"rollout tensor_model_parallel_size={r.tp}: with {kv} KV heads vLLM needs TP to divide {kv} or be a "
            f"multiple of it (KV heads replicated); valid rollout TP: {_choices(valid_tp)}",
        )
    if r.tp > s.num_experts:
        yield Violation(
            "rollout.tp_le_experts",
            f"rollout tensor_model_parallel_size={r.tp} is greater than num_experts ({s.num_experts})",
        )
    if r.tp * r.dp != w:
        yield Violation(
            "rollout.tp_dp_equals_world",
            f"rollout TP*DP = {r.tp}*{r.dp} = {r.tp * r.dp} must equal the rollout's device count {w} "
            f"({'its own pool' if c.layout.separate_rollout else 'colocated: the training world size'}); "
            f"with rollout TP={r.tp} use data_parallel_size={w // r.tp if w % r.tp == 0 else 'n/a'}",
        )
    if r.ep not in (1, r.tp * r.dp):
        yield Violation(
            "rollout.moe_pure_ep_or_tp",
            f"rollout expert_parallel_size={r.ep}: vLLM{'-Ascend' if c.layout.cluster.device == 'npu' else ''} runs MoE "
            f"with pure EP (EP = TP*DP = {r.tp * r.dp}) or pure TP (EP = 1), never mixed; set rollout "
            f"expert_parallel_size: {r.tp * r.dp} (or 1)",
        )
    elif s.num_experts % r.ep:
        yield Violation(
            "rollout.ep_divides_experts",
            f"rollout expert_parallel_size={r.ep}: num_experts ({s.num_experts}) must be divisible by it",
        )


@rule
def cluster(c: Context):
    cl = c.layout.cluster
    if cl.npu_kind is not None and cl.device != "npu":
        yield Violation("cluster.npu_kind", f"trainer.npu_kind={cl.npu_kind} is set but trainer.device={cl.device}")


def validate(spec: ModelSpec, layout: Layout, seq_len: int) -> list[Violation]:
    """Every violated rule of the layout for this model and cluster (empty when valid)."""
    ctx = Context(spec, layout, seq_len)
    return [v for check in RULES for v in check(ctx)]


def notes(spec: ModelSpec, layout: Layout) -> list[str]:
    """Facts worth knowing about a valid layout (not errors)."""
    out = []
    r, kv = layout.rollout, spec.num_query_groups
    if r.tp > kv:
        out.append(
            f"rollout TP={r.tp} > {kv} KV heads: vLLM replicates each KV head {r.tp // kv}x; the KV cache per "
            f"device is no smaller than at TP={kv}"
        )
    return out
