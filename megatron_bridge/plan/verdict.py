"""A layout's verdict for a model and cluster: every violated rule, the memory per device and the
MC2 facts (``evaluate``), as text or JSON. What ``python -m megatron_bridge.plan check`` prints and
what the recipe checks its layout with before anything starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_bridge.plan import mc2, memory
from megatron_bridge.plan.batching import TokenBudget, least_budget, rows_of
from megatron_bridge.plan.step_time import TERMS, StepTime
from megatron_bridge.plan.layout import Layout
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.plan.validate import Violation, notes, validate


@dataclass
class Verdict:
    layout: Layout
    violations: list[Violation]
    memory: memory.MemoryReport | None
    mc2: mc2.Mc2Plan | None
    notes: list[str]
    # the longest sequence whose training fits (memory.longest_sequence), when asked for and known
    longest_sequence: int | None = None
    step: StepTime | None = None  # the predicted RL step (step_time), where the rates are known
    rows: float = 1  # sequences of the planned length in one training micro-batch

    @property
    def valid(self) -> bool:
        return not self.violations


def memory_violations(report: memory.MemoryReport) -> list[Violation]:
    out = []
    gib = gib_text  # MiB for a small figure
    if report.train_fits is False:
        out.append(Violation(
            "memory.train_fits",
            f"training needs about {gib(report.train_peak)} per device on pipeline stage {report.pp_rank} "
            f"(weights, grads, optimizer {gib(report.static.total)} exact; activations, logits and routing ids "
            f"{gib(report.activations + report.logits + report.routing)} estimated) but the device has {gib(report.device_bytes)}; "
            "raise PP or EP, turn on full recompute, split the sequences over more context_parallel_size ranks, "
            "or use more devices",
        ))
    if report.rollout_pool is not None and report.rollout_fits is False:
        out.append(Violation(
            "memory.rollout_pool_fits",
            f"rollout pool: the rollout weights ({gib(report.rollout_weights)} per device) must be less than the "
            f"gpu_memory_utilization share ({gib(report.rollout_share)} of {gib(report.device_bytes)}), which "
            "also holds the KV cache; raise rollout TP or DP (more rollout devices) or gpu_memory_utilization",
        ))
    elif report.rollout_fits is False:
        out.append(Violation(
            "memory.rollout_fits",
            f"rollout: gpu_memory_utilization share {gib(report.rollout_share)} + training state kept on the device "
            f"{gib(report.resident_during_rollout)} must fit in {gib(report.device_bytes)}, and the share must exceed "
            f"the rollout weights ({gib(report.rollout_weights)}); offload training state (param/grad/optimizer_offload) "
            "or change gpu_memory_utilization / rollout TP",
        ))
    return out


def evaluate(spec: ModelSpec, layout: Layout, seq_len: int, micro_batch: float | TokenBudget = 1,
             reference: bool = False, packed: bool = True,
             log_prob_chunk_size: int = memory.LOG_PROB_CHUNK_TOKENS, longest: bool = False,
             log_prob: float | TokenBudget | None = None) -> Verdict:
    """The layout's verdict; the memory terms as ``memory.estimate`` takes them; with ``longest``,
    also the longest sequence that fits. ``micro_batch``: the training micro-batch, in rows or as a
    token budget (dynamic batch size: the sequences of ``seq_len`` it holds); ``log_prob``: the
    log-prob passes' micro-batch, likewise, where it is not the training one."""
    violations = (validate(spec, layout, seq_len) + budget_violations(layout, seq_len, micro_batch, "--max-token-len")
                  + budget_violations(layout, seq_len, log_prob, "--log-prob-max-token-len"))
    if violations:
        return Verdict(layout, violations, None, None, [])
    rows = rows_of(micro_batch, layout, seq_len)
    log_prob_rows = None if log_prob is None else rows_of(log_prob, layout, seq_len)
    report = memory.estimate(spec, layout, seq_len, rows, reference, packed, log_prob_chunk_size, log_prob_rows)
    fitting = (memory.longest_sequence(spec, layout, micro_batch, reference, packed, log_prob_chunk_size, log_prob)
               if longest else None)
    return Verdict(
        layout, memory_violations(report), report,
        mc2.plan_mc2(spec, layout, layout.rollout.max_num_seqs), notes(spec, layout), fitting, rows=rows,
    )


def budget_violations(layout: Layout, seq_len: int, micro_batch: float | TokenBudget | None,
                      flag: str) -> list[Violation]:
    """A micro-batch given as a token budget (``flag``'s) holds at least one sequence, or no
    micro-batch can be cut (the actor refuses the batch)."""
    if not isinstance(micro_batch, TokenBudget) or micro_batch.holds(layout.train, seq_len):
        return []
    t = layout.train
    return [Violation(
        "batch.token_budget_holds_sequence",
        f"a micro-batch of {micro_batch.tokens} tokens per device cannot hold a sequence of {seq_len} tokens"
        + (f" (each of the CP={t.cp} ranks holds 1/{t.cp} of it)" if t.cp > 1 else "")
        + f": raise {flag} to at least {least_budget(t, seq_len)}, or context_parallel_size",
    )]


# ---- output --------------------------------------------------------------------------------


def gib_text(b: int | None) -> str:
    if b is None:
        return "n/a"
    return f"{b / memory.GIB:.2f} GiB" if b >= memory.GIB / 10 else f"{b / 1024**2:.2f} MiB"


def describe(layout: Layout) -> str:
    t, r = layout.train, layout.rollout
    pp = f"PP{t.pp}"
    if t.first_stage_layers or t.last_stage_layers:
        pp += f"({t.first_stage_layers or '-'}/../{t.last_stage_layers or '-'})"
    if t.vpp:
        pp += f"xVPP{t.vpp}"
    train = f"TP{t.tp} {pp} EP{t.ep} ETP{t.expert_tp} CP{t.cp}" + (" SP" if t.sequence_parallel else "")
    return f"train {train} | rollout TP{r.tp} DP{r.dp} EP{r.ep}"


def print_verdict(spec: ModelSpec, v: Verdict, seq_len: int, micro_batch: float | TokenBudget | None = None) -> None:
    """``v`` as text; ``micro_batch``: the training micro-batch it was planned for, where it is a
    token budget (the printout names it)."""
    cl = v.layout.cluster
    budget = micro_batch if isinstance(micro_batch, TokenBudget) else None
    print(f"model {spec.name}: {spec.total_params / 1e9:.2f}B params, {spec.active_params / 1e9:.2f}B active")
    print(f"layout {v.layout.name}: {describe(v.layout)}")
    print(f"cluster: {cl.nnodes} x {cl.devices_per_node} {cl.device}{' ' + cl.npu_kind if cl.npu_kind else ''} = "
          f"{cl.world_size} devices, {cl.device_memory_gb or '?'} GiB each; seq_len {seq_len}")
    if budget is not None and v.memory is not None:
        print(f"micro-batch: {budget.tokens:,} tokens per device (dynamic batch size), planned as {v.rows:.3g} "
              f"sequence(s) of {seq_len:,} tokens")
    if v.layout.separate_rollout:
        r = v.layout.rollout
        print(f"rollout pool: {r.nnodes or 1} x {r.devices_per_node} {cl.device} = {v.layout.rollout_world_size} "
              "devices of its own (hybrid_engine=false)")
    if not v.valid and v.memory is None:
        print(f"INVALID: {len(v.violations)} rule(s) violated")
        for violation in v.violations:
            print(f"  - {violation}")
        return
    m = v.memory
    dp, edp = memory.data_parallel_sizes(v.layout)
    print(f"data parallel: DP*CP={dp} (dense optimizer shards), EDP={edp} (expert optimizer shards)")
    print(f"memory per device, worst pipeline stage ({m.pp_rank}):")
    for name, value, exact in m.terms:
        print(f"  {name:<40} {gib_text(value):>12}  {'exact' if exact else 'estimate'}")
    print(f"  {'training peak':<40} {gib_text(m.train_peak):>12}")
    if m.rollout_pool is None:
        print(f"  {'rollout weights (bf16)':<40} {gib_text(m.rollout_weights):>12}  exact")
        print(f"  {'rollout share (gpu_memory_utilization)':<40} {gib_text(m.rollout_share):>12}")
        print(f"  {'training state kept during rollout':<40} {gib_text(m.resident_during_rollout):>12}  {_offloaded(v.layout)}")
        print(f"  {'host copy of offloaded state (pinned)':<40} {gib_text(m.offload_host):>12}")
    else:
        _print_rollout_pool(v.layout, m.rollout_pool)
    print(f"checkpoint (bf16 weights, fp32 main params and Adam moments): {gib_text(m.checkpoint_total)} in "
          f"total, about {gib_text(m.checkpoint_per_rank)} written per rank")
    fits = {None: "unknown (give --device-memory-gb)", True: "yes", False: "NO"}
    print(f"fits: training {fits[m.train_fits]}, rollout {fits[m.rollout_fits]}")
    if v.longest_sequence is not None:
        t = v.layout.train
        held = budget is not None and v.longest_sequence + t.seq_multiple > budget.tokens * t.cp
        why = "as long as the token budget holds" if held else "estimate, at this " + (
            "token budget" if budget else "micro-batch size")
        print(f"longest sequence whose training fits: {v.longest_sequence:,} tokens ({why}; the model's "
              f"max_position_embeddings: {spec.max_position_embeddings:,})")
    if v.step is not None:
        print_step_time(v.step)
    p = v.mc2
    if p.applies:
        print(f"rollout MoE communication: {p.method} ({p.reason})")
        print(f"HCCL_BUFFSIZE: {p.hccl_buffsize_mb} MB (MC2 needs {p.needed_buffsize_mb} MB for "
              f"{p.max_tokens_per_rank} tokens per rank per MoE call)")
    else:
        print(f"rollout MoE communication: no MC2 ({p.reason}); HCCL_BUFFSIZE: default")
    for note in v.notes:
        print(f"note: {note}")
    if v.violations:
        print(f"INVALID: {len(v.violations)} rule(s) violated")
        for violation in v.violations:
            print(f"  - {violation}")
    else:
        print("VALID")


def print_step_time(step: StepTime) -> None:
    """The predicted RL step and where its time goes (an ESTIMATE: nothing of it is measured here)."""
    a = step.assumptions
    print(f"predicted RL step (ESTIMATE; rates: {step.rates.hardware}, MFU {a.mfu:g}, link efficiency "
          f"{a.link_efficiency:g}, HBM efficiency {a.hbm_efficiency:g}, gradient sync "
          f"{'overlapped' if a.overlap_grad_sync else 'not overlapped'}):")
    for key, label in TERMS:
        seconds = step.seconds[key]
        if seconds:
            print(f"  {label:<44} {_step_seconds(seconds):>10} s  {seconds / step.total:>4.0%}")
    print(f"  {'step':<44} {_step_seconds(step.total):>10} s  ({step.schedule})")
    print(f"  rollout decode: {step.decode_tokens_per_s:,.0f} tokens/s over the whole rollout")


def _step_seconds(seconds: float) -> str:
    """Tenths of a second, or milliseconds for a step under 10 s (a CPU rank's tiny model)."""
    return f"{seconds:.1f}" if seconds >= 10 else f"{seconds:.3f}"


def step_time_json(step: StepTime) -> dict:
    r = step.rates
    return {"total": step.total, "schedule": step.schedule, "terms": dict(step.seconds),
            "decode_tokens_per_s": step.decode_tokens_per_s,
            "rates": {"hardware": r.hardware, "flops": r.flops, "hbm_bytes_s": r.hbm,
                      "intra_node_bytes_s": r.intra, "inter_node_bytes_s": r.inter},
            "assumptions": asdict(step.assumptions)}


def _print_rollout_pool(layout: Layout, pool: memory.RolloutPoolMemory) -> None:
    """The rollout pool's device: the engine alone (the training devices keep no rollout share)."""
    r = layout.rollout
    print(f"memory per rollout device (TP{r.tp} DP{r.dp} EP{r.ep}; no training state there):")
    print(f"  {'rollout weights (bf16)':<40} {gib_text(pool.weights):>12}  exact")
    print(f"  {'rollout share (gpu_memory_utilization)':<40} {gib_text(pool.share):>12}")
    print(f"  {'KV cache budget (share - weights)':<40} {gib_text(pool.kv_cache):>12}")


def _offloaded(layout: Layout) -> str:
    t = layout.train
    moved = [name for name, on in (("weights", t.param_offload), ("optimizer", t.optimizer_offload)) if on]
    parts = [f"{' and '.join(moved)} to host"] if moved else []
    parts += ["grads freed"] if t.grad_offload else []
    return f"({'; '.join(parts)})" if parts else "(no offload)"


def verdict_json(v: Verdict) -> dict:
    out = {"layout": v.layout.name, "valid": v.valid,
           "violations": [{"rule": x.rule, "message": x.message} for x in v.violations]}
    if v.memory is not None:
        out["memory_bytes"] = {name: value for name, value, _ in v.memory.terms}
        out["memory_bytes"]["training_peak"] = v.memory.train_peak
        if v.memory.rollout_pool is None:
            out["memory_bytes"]["kept_during_rollout"] = v.memory.resident_during_rollout
            out["memory_bytes"]["offload_host"] = v.memory.offload_host
        out["fits"] = v.memory.fits
        out["micro_batch_sequences"] = v.rows
        if v.longest_sequence is not None:
            out["longest_sequence"] = v.longest_sequence
        out["checkpoint_bytes"] = {"total": v.memory.checkpoint_total, "per_rank": v.memory.checkpoint_per_rank}
    if v.layout.separate_rollout:
        out["rollout_pool"] = _rollout_pool_json(v.layout, v.memory)
    if v.mc2 is not None:
        out["mc2"] = {"method": v.mc2.method, "hccl_buffsize_mb": v.mc2.hccl_buffsize_mb}
    if v.step is not None:
        out["step_time_s"] = step_time_json(v.step)
    return out


def _rollout_pool_json(layout: Layout, report: memory.MemoryReport | None) -> dict:
    r = layout.rollout
    out = {"nnodes": r.nnodes or 1, "devices_per_node": r.devices_per_node, "devices": layout.rollout_world_size,
           "tp": r.tp, "dp": r.dp, "ep": r.ep, "gpu_memory_utilization": r.gpu_memory_utilization}
    if report is not None:  # a layout that breaks a rule has no memory plan
        pool = report.rollout_pool
        out["memory_bytes"] = {"weights": pool.weights, "share": pool.share, "kv_cache": pool.kv_cache}
        out["fits"] = pool.fits
    return out
