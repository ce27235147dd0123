"""Check a parallel layout, or search for one, before a single device is touched.

    python -m megatron_bridge.plan check  --model M --parallel P [--nnodes N --devices-per-node D --device-memory-gb G]
    python -m megatron_bridge.plan search --model M --nnodes N --devices-per-node D [--device-memory-gb G] [--top K] [--write out.yaml]

Exit codes: 0 valid, 1 invalid (every violated rule is printed), 2 unusable arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace

import yaml

from megatron_bridge.plan import mc2, memory
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import Cluster, Layout, RolloutParallel, TrainParallel, layout_to_dict, load_layout
from megatron_bridge.plan.model_spec import ModelSpec, load_model_spec
from megatron_bridge.plan.validate import Violation, divisors, notes, rollout_tp_ok, validate

DEFAULT_SEQ_LEN = 4096


@dataclass
class Verdict:
    layout: Layout
    violations: list[Violation]
    memory: memory.MemoryReport | None
    mc2: mc2.Mc2Plan | None
    notes: list[str]

    @property
    def valid(self) -> bool:
        return not self.violations


def memory_violations(report: memory.MemoryReport) -> list[Violation]:
    out = []
    gib = lambda b: f"{b / memory.GIB:.1f} GiB"  # noqa: E731
    if report.train_fits is False:
        out.append(Violation(
            "memory.train_fits",
            f"training needs about {gib(report.train_peak)} per device on pipeline stage {report.pp_rank} "
            f"(weights, grads, optimizer {gib(report.static.total)} exact; activations, logits and routing ids "
            f"{gib(report.activations + report.logits + report.routing)} estimated) but the device has {gib(report.device_bytes)}; "
            "raise PP or EP, turn on full recompute, or use more devices",
        ))
    if report.rollout_fits is False:
        out.append(Violation(
            "memory.rollout_fits",
            f"rollout: gpu_memory_utilization share {gib(report.rollout_share)} + training state kept on the device "
            f"{gib(report.resident_during_rollout)} must fit in {gib(report.device_bytes)}, and the share must exceed "
            f"the rollout weights ({gib(report.rollout_weights)}); offload training state (param/grad/optimizer_offload) "
            "or change gpu_memory_utilization / rollout TP",
        ))
    return out


def evaluate(spec: ModelSpec, layout: Layout, seq_len: int, micro_batch_size: int = 1,
             reference: bool = False) -> Verdict:
    violations = validate(spec, layout, seq_len)
    if violations:
        return Verdict(layout, violations, None, None, [])
    report = memory.estimate(spec, layout, seq_len, micro_batch_size, reference)
    return Verdict(
        layout, memory_violations(report), report,
        mc2.plan_mc2(spec, layout, layout.rollout.max_num_seqs), notes(spec, layout),
    )


# ---- output --------------------------------------------------------------------------------


def _gib(b: int | None) -> str:
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


def print_verdict(spec: ModelSpec, v: Verdict, seq_len: int) -> None:
    cl = v.layout.cluster
    print(f"model {spec.name}: {spec.total_params / 1e9:.2f}B params, {spec.active_params / 1e9:.2f}B active")
    print(f"layout {v.layout.name}: {describe(v.layout)}")
    print(f"cluster: {cl.nnodes} x {cl.devices_per_node} {cl.device}{' ' + cl.npu_kind if cl.npu_kind else ''} = "
          f"{cl.world_size} devices, {cl.device_memory_gb or '?'} GiB each; seq_len {seq_len}")
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
        print(f"  {name:<40} {_gib(value):>12}  {'exact' if exact else 'estimate'}")
    print(f"  {'training peak':<40} {_gib(m.train_peak):>12}")
    print(f"  {'rollout weights (bf16)':<40} {_gib(m.rollout_weights):>12}  exact")
    print(f"  {'rollout share (gpu_memory_utilization)':<40} {_gib(m.rollout_share):>12}")
    print(f"  {'training state kept during rollout':<40} {_gib(m.resident_during_rollout):>12}  {_offloaded(v.layout)}")
    print(f"  {'host copy of offloaded state (pinned)':<40} {_gib(m.offload_host):>12}")
    fits = {None: "unknown (give --device-memory-gb)", True: "yes", False: "NO"}
    print(f"fits: training {fits[m.train_fits]}, rollout {fits[m.rollout_fits]}")
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
        out["memory_bytes"]["kept_during_rollout"] = v.memory.resident_during_rollout
        out["memory_bytes"]["offload_host"] = v.memory.offload_host
        out["fits"] = v.memory.fits
    if v.mc2 is not None:
        out["mc2"] = {"method": v.mc2.method, "hccl_buffsize_mb": v.mc2.hccl_buffsize_mb}
    return out


# ---- search --------------------------------------------------------------------------------


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
    t = v.layout.train
    cross_node_tp = t.tp > devices_per_node
    return (cross_node_tp, _tight(v), t.pp, t.tp, t.expert_tp, -t.ep, v.memory.train_peak)


def why(v: Verdict, devices_per_node: int) -> str:
    t = v.layout.train
    parts = ["TP within a node" if t.tp <= devices_per_node else "TP crosses nodes (slow)"]
    parts.append("no pipeline bubble" if t.pp == 1 else f"{t.pp} pipeline stages")
    if t.expert_tp == 1:
        parts.append("whole experts per device (ETP1)")
    parts.append(f"{t.ep} expert shards")
    if v.memory.device_bytes:
        share = v.memory.train_peak / v.memory.device_bytes
        parts.append(f"peak {share:.0%} of device" + (" (tight)" if _tight(v) else ""))
    return ", ".join(parts)


def search(spec: ModelSpec, cluster: Cluster, seq_len: int, micro_batch_size: int, recompute: bool,
           utilization: float, offload: bool, include_oom: bool, reference: bool = False) -> list[Verdict]:
    verdicts = []
    for layout in candidates(spec, cluster, recompute, utilization, offload):
        if validate(spec, layout, seq_len):
            continue  # search shows structurally valid layouts only
        v = evaluate(spec, layout, seq_len, micro_batch_size, reference)
        if v.valid or include_oom:
            verdicts.append(v)
    return sorted(verdicts, key=lambda v: (not v.valid, rank_key(v, cluster.devices_per_node)))


def print_table(verdicts: list[Verdict], devices_per_node: int) -> None:
    header = f"{'#':>3}  {'layout':<55} {'train peak':>12} {'static':>11} {'fits':>5}  why ranked here"
    print(header)
    print("-" * len(header))
    for i, v in enumerate(verdicts, 1):
        fits = {None: "?", True: "yes", False: "no"}[v.memory.fits]
        print(f"{i:>3}  {describe(v.layout):<55} {_gib(v.memory.train_peak):>12} "
              f"{_gib(v.memory.static.total):>11} {fits:>5}  {why(v, devices_per_node)}")


# ---- CLI -----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # unusable arguments exit 2 with a one-line reason
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m megatron_bridge.plan", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p, nodes_required: bool):
        p.add_argument("--model", required=True,
                       help="shipped model name (configs/model/*.yaml), a model YAML, a config.json or a HF checkpoint dir")
        p.add_argument("--nnodes", type=_positive_int, required=nodes_required, help="number of nodes")
        p.add_argument("--devices-per-node", type=_positive_int, required=nodes_required, help="accelerators per node")
        p.add_argument("--device-memory-gb", type=_positive_float, help="memory per device in GiB (e.g. 64 for Atlas A2/A3)")
        p.add_argument("--seq-len", type=_positive_int, default=DEFAULT_SEQ_LEN,
                       help=f"tokens per sequence (prompt + response) for activation and CP/SP checks (default {DEFAULT_SEQ_LEN})")
        p.add_argument("--micro-batch-size", type=_positive_int, default=1, help="sequences per micro-batch (default 1)")
        p.add_argument("--reference-model", action="store_true",
                       help="count a reference model's weights (KL loss or KL in reward, e.g. the GRPO recipes)")
        p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")

    check = sub.add_parser("check", help="validate one layout YAML for a model and cluster",
                           description="Validate a layout; print every violated rule, the memory per device and MC2 facts.")
    common(check, nodes_required=False)
    check.add_argument("--parallel", required=True, help="layout YAML (configs/parallel/*.yaml) or a shipped layout name")

    srch = sub.add_parser("search", help="rank valid layouts for a model and cluster",
                          description="Enumerate TP/PP/EP/ETP layouts, keep the valid ones that fit, rank them.")
    common(srch, nodes_required=True)
    srch.add_argument("--device", choices=["npu", "cuda", "cpu"], default="npu", help="device kind (default npu)")
    srch.add_argument("--npu-kind", choices=["a2", "a3"], help="Atlas A2 or A3 (decides MC2)")
    srch.add_argument("--top", type=_positive_int, default=10, help="rows to print (default 10)")
    srch.add_argument("--write", metavar="OUT.yaml", help="write the best layout as a layout YAML")
    srch.add_argument("--no-recompute", action="store_true", help="plan without full activation recompute")
    srch.add_argument("--no-offload", action="store_true", help="keep training state on the device during rollout")
    srch.add_argument("--gpu-memory-utilization", type=_positive_float, default=0.5,
                      help="rollout engine share of device memory (default 0.5)")
    srch.add_argument("--include-oom", action="store_true", help="also list valid layouts that do not fit in memory")
    return parser


def _cluster_overrides(args) -> dict:
    return {"nnodes": args.nnodes, "devices_per_node": args.devices_per_node, "device_memory_gb": args.device_memory_gb}


def run_check(args) -> int:
    spec = load_model_spec(args.model)
    layout = load_layout(args.parallel).with_cluster(**_cluster_overrides(args))
    v = evaluate(spec, layout, args.seq_len, args.micro_batch_size, args.reference_model)
    if args.json:
        print(json.dumps(verdict_json(v), indent=2))
    else:
        print_verdict(spec, v, args.seq_len)
    return 0 if v.valid else 1


def run_search(args) -> int:
    spec = load_model_spec(args.model)
    if args.npu_kind and args.device != "npu":
        raise ConfigError("--npu-kind needs --device npu")
    cluster = Cluster(nnodes=args.nnodes, devices_per_node=args.devices_per_node, device=args.device,
                      npu_kind=args.npu_kind, device_memory_gb=args.device_memory_gb)
    if not 0 < args.gpu_memory_utilization < 1:
        raise ConfigError("--gpu-memory-utilization must be in (0, 1)")
    verdicts = search(spec, cluster, args.seq_len, args.micro_batch_size, not args.no_recompute,
                      args.gpu_memory_utilization, not args.no_offload, args.include_oom, args.reference_model)
    shown = verdicts[: args.top]
    if args.json:
        print(json.dumps([verdict_json(v) for v in shown], indent=2))
    else:
        print(f"{spec.name} on {cluster.nnodes} x {cluster.devices_per_node} "
              f"({cluster.device_memory_gb or '?'} GiB each), seq_len {args.seq_len}: "
              f"{len(verdicts)} valid layout(s){'' if args.include_oom else ' that fit'}, best first")
        if shown:
            print_table(shown, cluster.devices_per_node)
    if not verdicts:
        print("no valid layout fits; try more devices, --seq-len smaller, or --include-oom to see the closest",
              file=sys.stderr)
        return 1
    if args.write:
        best = replace(verdicts[0].layout, name=args.write)
        tmp = f"{args.write}.tmp"
        with open(tmp, "w") as f:  # written whole, then renamed: never a half-written layout
            f.write(f"# written by: python -m megatron_bridge.plan search --model {args.model} "
                    f"--nnodes {args.nnodes} --devices-per-node {args.devices_per_node}\n")
            yaml.safe_dump(layout_to_dict(best), f, sort_keys=False)
        os.replace(tmp, args.write)
        print(f"wrote {args.write}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_check(args) if args.command == "check" else run_search(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
