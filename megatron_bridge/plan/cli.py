"""Check a parallel layout, or search for one, before a single device is touched.

    python -m megatron_bridge.plan check  --model M --parallel P [--nnodes N --devices-per-node D --device-memory-gb G]
                                          [--rollout-nnodes RN --rollout-devices-per-node RD]
    python -m megatron_bridge.plan search --model M --nnodes N --devices-per-node D [--device-memory-gb G] [--top K] [--write out.yaml]

Both predict an RL step's time per layout (an ESTIMATE, megatron_bridge.plan.step_time) for a
workload (--seq-len, --prompt-len, --response-len, --global-batch, --mini-batch) at the rates of a
hardware sheet (configs/hardware/, --hardware) or your own (--tflops, --hbm-bandwidth,
--link-bandwidth), under switchable assumptions (--mfu, --link-efficiency, --hbm-efficiency,
--overlap-grad-sync); search ranks the layouts that fit by it. Micro-batches hold --micro-batch-size
sequences, or with dynamic batch size (--max-token-len) as many as a token budget holds.

Exit codes: 0 valid, 1 invalid (every violated rule is printed), 2 unusable arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import yaml

from megatron_bridge.atomic import write_text
from megatron_bridge.errors import ConfigError
from megatron_bridge.plan import memory
from megatron_bridge.plan.batching import TokenBudget
from megatron_bridge.plan.hardware import Assumptions, Overrides, Rates, hardware_for, load_hardware
from megatron_bridge.plan.layout import Cluster, layout_to_dict, load_layout
from megatron_bridge.plan.model_spec import load_model_spec
from megatron_bridge.plan.platforms import PLATFORMS
from megatron_bridge.plan.search import search, why
from megatron_bridge.plan.step_time import CostModel, Workload
from megatron_bridge.plan.verdict import Verdict, describe, evaluate, gib_text, print_verdict, verdict_json

DEFAULT_SEQ_LEN = 4096
# configs/recipe/qwen3_30b_a3b_gspo.yaml: 256 prompts x 16 responses per RL step, mini-batches of
# 32 prompts, prompts of at most 2048 tokens
DEFAULT_GLOBAL_BATCH = 256 * 16
DEFAULT_MINI_BATCH = 32 * 16
DEFAULT_PROMPT_LEN = 2048
NO_RATES = ("no predicted step: no rates for {device} devices; give --tflops, --hbm-bandwidth and "
            "--link-bandwidth intra=GB/s,inter=GB/s")


def _seconds(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.1f}"


def print_table(verdicts: list[Verdict], devices_per_node: int) -> None:
    """One row a layout; with a predicted step, its seconds: the whole step, compute, communication
    (collectives, pipeline bubble and sends, weight sync) and the rollout."""
    timed = verdicts[0].step is not None
    step_header = f" {'step s':>7} {'compute':>8} {'comm':>7} {'rollout':>8}" if timed else ""
    header = f"{'#':>3}  {'layout':<55} {'train peak':>12} {'static':>11} {'fits':>5}{step_header}  why ranked here"
    print(header)
    print("-" * len(header))
    for i, v in enumerate(verdicts, 1):
        fits = {None: "?", True: "yes", False: "no"}[v.memory.fits]
        step = ""
        if timed:
            sec = v.step.seconds
            comm = sum(sec.values()) - sec["compute"] - sec["rollout"]
            step = (f" {_seconds(v.step.total):>7} {_seconds(sec['compute']):>8} {_seconds(comm):>7} "
                    f"{_seconds(sec['rollout']):>8}")
        print(f"{i:>3}  {describe(v.layout):<55} {gib_text(v.memory.train_peak):>12} "
              f"{gib_text(v.memory.static.total):>11} {fits:>5}{step}  {why(v, devices_per_node)}")


# ---- the command ----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # unusable arguments exit 2 with a one-line reason
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{value} must be <= 1 (a share of the peak)")
    return value


LINKS = ("intra", "inter")


def _links(text: str) -> dict[str, float]:
    """An argparse type: ``intra=GB/s,inter=GB/s`` (either or both)."""
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in LINKS:
            raise argparse.ArgumentTypeError(f"{item!r}: expected intra=GB/s and/or inter=GB/s, e.g. intra=149,inter=25")
        out[key.strip()] = _positive_float(value)
    return out


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
        batch = p.add_mutually_exclusive_group()
        batch.add_argument("--micro-batch-size", type=_positive_int, default=1, help="sequences per micro-batch (default 1)")
        batch.add_argument("--max-token-len", type=_positive_int, metavar="TOKENS",
                           help="dynamic batch size instead: tokens per device a micro-batch holds (the actor's "
                                "ppo_max_token_len_per_gpu); memory is planned for as many --seq-len sequences as "
                                "that holds, the step time for as many mean-length ones, at most a DP rank's share "
                                "of --mini-batch (of --global-batch for the log-prob passes)")
        log_prob = p.add_mutually_exclusive_group()
        log_prob.add_argument("--log-prob-micro-batch-size", type=_positive_int, metavar="B",
                              help="the log-prob passes' own sequences per micro-batch (log_prob_micro_batch_size_per_gpu) "
                                   "where they differ from training's: their forward-only peak (its logits) is "
                                   "planned too, and their step time with it")
        log_prob.add_argument("--log-prob-max-token-len", type=_positive_int, metavar="TOKENS",
                              help="or their own token budget per micro-batch (log_prob_max_token_len_per_gpu), "
                                   "likewise")
        p.add_argument("--reference-model", action="store_true",
                       help="count a reference model's weights (KL loss or KL in reward, e.g. the GRPO recipes)")
        p.add_argument("--padded", action="store_true",
                       help="micro-batches padded to their longest row (use_remove_padding=false); default packed")
        p.add_argument("--log-prob-chunk-size", type=_int_at_least(0), default=memory.LOG_PROB_CHUNK_TOKENS,
                       help="tokens a chunk of the log-prob and entropy pass holds in float32 "
                            f"(actor.megatron.log_prob_chunk_size; default {memory.LOG_PROB_CHUNK_TOKENS}, 0: no chunks)")
        p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
        step = p.add_argument_group("predicted step time (an ESTIMATE; docs/launch.md, 'Predicted step time')")
        step.add_argument("--prompt-len", type=_positive_int,
                          help=f"mean prompt tokens (default {DEFAULT_PROMPT_LEN}, at most half of --seq-len)")
        step.add_argument("--response-len", type=_positive_int,
                          help="mean response tokens (default --seq-len - --prompt-len: every response as long "
                               "as allowed); the longest is --seq-len - --prompt-len")
        step.add_argument("--global-batch", type=_positive_int, default=DEFAULT_GLOBAL_BATCH,
                          help=f"sequences per RL step, prompts x responses (default {DEFAULT_GLOBAL_BATCH})")
        step.add_argument("--mini-batch", type=_positive_int, default=DEFAULT_MINI_BATCH,
                          help=f"sequences per optimizer step (default {DEFAULT_MINI_BATCH})")
        step.add_argument("--hardware", help="a hardware sheet (configs/hardware/*.yaml, by name or path); "
                                             "default: the cluster's device (A2, A3, H100)")
        step.add_argument("--tflops", type=_positive_float, help="peak bf16 TFLOPS per device (the MFU applies)")
        step.add_argument("--hbm-bandwidth", type=_positive_float, help="memory GB/s per device, as achieved")
        step.add_argument("--link-bandwidth", type=_links, default={}, metavar="intra=GB/s,inter=GB/s",
                          help="per device, one direction, as achieved (e.g. intra=149,inter=25)")
        defaults = Assumptions()
        step.add_argument("--mfu", type=_fraction, default=defaults.mfu,
                          help=f"share of peak bf16 the kernels reach (default {defaults.mfu})")
        step.add_argument("--link-efficiency", type=_fraction, default=defaults.link_efficiency,
                          help=f"share of a link's peak a collective reaches (default {defaults.link_efficiency})")
        step.add_argument("--hbm-efficiency", type=_fraction, default=defaults.hbm_efficiency,
                          help=f"share of peak memory bandwidth decoding reaches (default {defaults.hbm_efficiency})")
        step.add_argument("--overlap-grad-sync", action="store_true",
                          help="gradient reduce-scatter and parameter all-gather overlap compute "
                               "(megatron's overlap_grad_reduce / overlap_param_gather; off in this project's actor)")

    check = sub.add_parser("check", help="validate one layout YAML for a model and cluster",
                           description="Validate a layout; print every violated rule, the memory per device and MC2 facts.")
    common(check, nodes_required=False)
    check.add_argument("--parallel", required=True, help="layout YAML (configs/parallel/*.yaml) or a shipped layout name")
    check.add_argument("--rollout-nnodes", type=_positive_int,
                       help="the rollout on nodes of its own (hybrid_engine=false): their number; "
                            "with --rollout-devices-per-node")
    check.add_argument("--rollout-devices-per-node", type=_positive_int,
                       help="accelerators per node of the rollout's own pool; with --rollout-nnodes")
    check.set_defaults(subparser=check)  # what names the command in an error about these flags

    srch = sub.add_parser("search", help="rank valid layouts for a model and cluster",
                          description="Enumerate TP/PP/EP/ETP layouts, keep the valid ones that fit, rank them.")
    common(srch, nodes_required=True)
    srch.add_argument("--device", choices=list(PLATFORMS), default="npu", help="device kind (default npu)")
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


def _check_rollout_pool_flags(args) -> None:
    """--rollout-nnodes and --rollout-devices-per-node go together: one alone is an unusable argument."""
    given = {"--rollout-nnodes": args.rollout_nnodes, "--rollout-devices-per-node": args.rollout_devices_per_node}
    missing = [flag for flag, value in given.items() if value is None]
    if len(missing) == 1:
        (other,) = set(given) - set(missing)
        args.subparser.error(f"{other} needs {missing[0]} too (the rollout's own pool: nodes and devices per node)")


def cost_model(args, cluster: Cluster) -> CostModel | None:
    """The workload, rates and assumptions of the arguments; None when no rates are known."""
    prompt = args.prompt_len or min(DEFAULT_PROMPT_LEN, args.seq_len // 2)
    workload = Workload(seq_len=args.seq_len, prompt_len=prompt, response_len=args.response_len or args.seq_len - prompt,
                        global_batch=args.global_batch, mini_batch=args.mini_batch,
                        micro_batch_size=args.micro_batch_size, reference=args.reference_model,
                        max_token_len=args.max_token_len, log_prob_max_token_len=args.log_prob_max_token_len,
                        log_prob_micro_batch_size=args.log_prob_micro_batch_size)
    sheet = load_hardware(args.hardware) if args.hardware else hardware_for(cluster)
    if sheet is not None and sheet.device != cluster.device:
        raise ConfigError(f"--hardware {args.hardware}: a {sheet.device} sheet, the cluster's device is {cluster.device}")
    assume = Assumptions(mfu=args.mfu, link_efficiency=args.link_efficiency, hbm_efficiency=args.hbm_efficiency,
                         overlap_grad_sync=args.overlap_grad_sync)
    given = Overrides(tflops=args.tflops, hbm_gb_s=args.hbm_bandwidth,
                      intra_node_gb_s=args.link_bandwidth.get("intra"), inter_node_gb_s=args.link_bandwidth.get("inter"))
    rates = Rates.of(sheet, assume, given)
    return CostModel(workload, rates, assume) if rates else None


def micro_batch(args) -> int | TokenBudget:
    """The training micro-batch: --micro-batch-size rows, or --max-token-len's budget (capped by an
    optimizer step's rows)."""
    return args.micro_batch_size if args.max_token_len is None else TokenBudget(args.max_token_len, args.mini_batch)


def log_prob_micro_batch(args) -> int | TokenBudget | None:
    """The log-prob passes' own micro-batch where given: rows, or a budget (capped by an RL step's rows)."""
    if args.log_prob_max_token_len is not None:
        return TokenBudget(args.log_prob_max_token_len, args.global_batch)
    return args.log_prob_micro_batch_size


def run_check(args) -> int:
    spec = load_model_spec(args.model)
    layout = load_layout(args.parallel).with_cluster(**_cluster_overrides(args))
    if args.rollout_nnodes is not None:
        layout = layout.with_rollout_pool(args.rollout_nnodes, args.rollout_devices_per_node)
    cost = cost_model(args, layout.cluster)
    batch = micro_batch(args)
    v = evaluate(spec, layout, args.seq_len, batch, args.reference_model, not args.padded,
                 args.log_prob_chunk_size, longest=True, log_prob=log_prob_micro_batch(args))
    if cost is not None and v.memory is not None:  # a layout that breaks a rule has no plan to time
        v = replace(v, step=cost.predict(spec, layout))
    if args.json:
        print(json.dumps(verdict_json(v), indent=2))
    else:
        print_verdict(spec, v, args.seq_len, batch)
        if cost is None:
            print(NO_RATES.format(device=layout.cluster.device))
    return 0 if v.valid else 1


def run_search(args) -> int:
    spec = load_model_spec(args.model)
    if args.npu_kind and args.device != "npu":
        raise ConfigError("--npu-kind needs --device npu")
    cluster = Cluster(nnodes=args.nnodes, devices_per_node=args.devices_per_node, device=args.device,
                      npu_kind=args.npu_kind, device_memory_gb=args.device_memory_gb)
    if not 0 < args.gpu_memory_utilization < 1:
        raise ConfigError("--gpu-memory-utilization must be in (0, 1)")
    cost = cost_model(args, cluster)
    verdicts = search(spec, cluster, args.seq_len, micro_batch(args), not args.no_recompute,
                      args.gpu_memory_utilization, not args.no_offload, args.include_oom, args.reference_model,
                      not args.padded, args.log_prob_chunk_size, cost, log_prob_micro_batch(args))
    shown = verdicts[: args.top]
    if args.json:
        print(json.dumps([verdict_json(v) for v in shown], indent=2))
    else:
        print(f"{spec.name} on {cluster.nnodes} x {cluster.devices_per_node} "
              f"({cluster.device_memory_gb or '?'} GiB each), seq_len {args.seq_len}"
              + (f", micro-batches of {args.max_token_len:,} tokens per device" if args.max_token_len else "") + ": "
              f"{len(verdicts)} valid layout(s){'' if args.include_oom else ' that fit'}, best first")
        if cost is None:
            print(NO_RATES.format(device=cluster.device) + "; ranked by rules of thumb")
        else:
            w, a = cost.workload, cost.assumptions
            print(f"ranked by predicted RL step (ESTIMATE, seconds; rates: {cost.rates.hardware}, MFU {a.mfu:g}, "
                  f"link efficiency {a.link_efficiency:g}): {w.global_batch} sequences of {w.prompt_len} prompt + "
                  f"{w.response_len} response tokens (mean), {w.optimizer_steps} optimizer steps")
        if shown:
            print_table(shown, cluster.devices_per_node)
    if not verdicts:
        larger = ", --max-token-len larger (it must hold a --seq-len sequence)" if args.max_token_len else ""
        print(f"no valid layout fits; try more devices, --seq-len smaller{larger}, or --include-oom to see the closest",
              file=sys.stderr)
        return 1
    if args.write:
        best = replace(verdicts[0].layout, name=args.write)
        write_text(args.write, f"# written by: python -m megatron_bridge.plan search --model {args.model} "
                               f"--nnodes {args.nnodes} --devices-per-node {args.devices_per_node}\n"
                               + yaml.safe_dump(layout_to_dict(best), sort_keys=False))
        print(f"wrote {args.write}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        _check_rollout_pool_flags(args)
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
