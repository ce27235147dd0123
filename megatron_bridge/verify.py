"""Check, before a long job, that a HF checkpoint loads correctly into a parallel layout.

    python -m megatron_bridge.verify --hf-dir /models/Qwen3-30B-A3B --tp 2 --ep 2 --etp 1   # one node
    torchrun --nnodes 2 --nproc-per-node 16 ... -m megatron_bridge.verify --hf-dir ... --tp 4 --pp 2 --ep 8

Started without torchrun, it checks the layout, then starts torchrun itself on this node
(``--nproc-per-node``, default: the smallest world the layout fits) and exits with the status
below. Under torchrun, each rank exits with it and torchrun reports it in its failure summary
(torchrun's own exit status is 1 for any failure).

Every rank loads its shard of the checkpoint into the layout; the sharded model computes per-token
log-probs of a fixed random batch through the pipeline schedule, recording which experts each MoE
layer routes every token to; rank 0 computes the same with transformers' Qwen3-MoE on the CPU (it
needs the model's size in host memory) and compares both.

Exit status: 0 every check holds, 1 a check fails, 2 the layout or the checkpoint is invalid
(with the validator's or the loader's message).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

from megatron_bridge.errors import ConfigError

DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.5}
# Share of expert slots allowed to differ from transformers' top-k. fp32 routes identically; in
# bf16 near-tied router logits flip (about 10% of routers disagree between engines on
# Qwen3-30B-A3B, arXiv 2510.11370), while a wrongly loaded router differs in ~1 - k/E of its slots.
DEFAULT_ROUTING_TOLERANCE = {"fp32": 0.0, "bf16": 0.2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATUS_FILE_ENV = "MOE_RL_VERIFY_STATUS"  # where rank 0 writes the exit status for the launcher


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megatron_bridge.verify",
        description="Load a HF Qwen3-MoE checkpoint into a TP/PP/EP/ETP layout and compare its log-probs "
        "with transformers'. Run under torchrun with TP*PP*CP*DP processes.",
        epilog="exit status: 0 all checks hold, 1 a check fails, 2 invalid layout or checkpoint",
    )
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size")
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: TP)")
    p.add_argument("--platform", choices=("npu", "cuda", "cpu"), default=None, help="default: detected")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="model dtype (default: fp32 on cpu, else bf16)")
    p.add_argument("--tol", type=float, default=None,
                   help="max |delta log-prob| allowed on the tokens whose experts match transformers' in every layer "
                        f"(default: {DEFAULT_TOLERANCE['fp32']} fp32, {DEFAULT_TOLERANCE['bf16']} bf16)")
    p.add_argument("--routing-tol", type=float, default=None,
                   help="max share of expert slots whose expert differs from transformers' top-k (default: "
                        f"{DEFAULT_ROUTING_TOLERANCE['fp32']} fp32, {DEFAULT_ROUTING_TOLERANCE['bf16']} bf16)")
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token batch")
    p.add_argument("--backend", choices=("builtin", "mbridge"), default="builtin",
                   help="checkpoint loader; mbridge (needs Transformer Engine) is also checked against the built-in one")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="without torchrun: processes to start on this node (default: the smallest world for the layout)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p.parse_args(argv)


def _train_parallel(args: argparse.Namespace):
    from megatron_bridge.plan.layout import TrainParallel

    return TrainParallel(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp,
                         sequence_parallel=args.tp > 1)


def check_layout(args: argparse.Namespace, world_size: int, device: str):
    """(spec, train layout); raises ConfigError with every violated training rule."""
    from megatron_bridge.plan.layout import Cluster, Layout
    from megatron_bridge.plan.model_spec import load_model_spec
    from megatron_bridge.plan.validate import validate

    spec = load_model_spec(args.hf_dir)
    train = _train_parallel(args)
    layout = Layout("verify", train=train, cluster=Cluster(nnodes=1, devices_per_node=world_size, device=device))
    violations = [v for v in validate(spec, layout, args.seq_len) if not v.rule.startswith("rollout.")]
    if args.seq_len % args.tp:
        violations.append(f"--seq-len {args.seq_len} must be a multiple of --tp {args.tp} (sequence parallel)")
    if violations:
        raise ConfigError("invalid layout:\n  " + "\n  ".join(str(v) for v in violations))
    return spec, train


def random_batch(spec, args: argparse.Namespace, dp_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, spec.vocab_size, (args.batch * dp_size, args.seq_len), generator=generator)


def reference(hf_dir: str, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log p(token t+1 | tokens <= t) [B, S-1] and routing table [B, S, layers, k],
    fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.moe.hf_routing import HFRoutingRecorder

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    recorder = HFRoutingRecorder(model)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    routing = recorder.take().view(*input_ids.shape, recorder.layers, recorder.topk)
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1), routing


def whole_sequence_batch(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every token after the first scored: a one-token prompt and the rest as the response."""
    rows, length = input_ids.shape
    return {"input_ids": input_ids, "prompt_lengths": torch.ones(rows, dtype=torch.long),
            "response_mask": torch.ones(rows, length - 1)}


def sharded_log_probs(actor, batch: dict[str, torch.Tensor], micro_batch_size: int = 1):
    """Log-probs [B, R] of the batch's responses under the sharded model, and this rank's
    ``RoutingRecord`` of the pass."""
    from functools import partial

    from loss.megatron_hook import log_prob_func
    from megatron_bridge.moe.routing import RoutingTap

    rows, length = batch["input_ids"].shape
    tap = RoutingTap(actor.chunks, actor.spec.moe_topk, actor.train.sequence_parallel)
    actor.forward_context = tap.micro_batch
    with tap.recording(rows, length, capture=True, replay=False, training=False) as out:
        log_probs = actor.forward_only(batch, micro_batch_size, partial(log_prob_func, 1.0, False))["log_probs"]
    tap.remove()
    return log_probs.float().cpu(), out.record


def round_trip(chunks, spec, hf_dir: str, dtype: torch.dtype) -> tuple[list[str], list[str], int]:
    """Export the loaded shards through the rollout weight stream and compare each tensor with the
    checkpoint's (cast to the model dtype) bit for bit: (names received, names that differ, bytes).
    Rollout expert parallel is as wide as the experts and ranks allow, so each rank checks the
    dense tensors and its share of the experts."""
    from megatron_bridge.weights.export import Routing, WeightExporter
    from megatron_bridge.weights.hf_checkpoint import HFCheckpoint

    world = torch.distributed.get_world_size()
    routing = Routing(world, spec.num_experts, math.gcd(spec.num_experts, world))
    exporter = WeightExporter(chunks, spec, routing, bucket_mb=64, dtype=dtype)
    seen, differ = [], []
    with HFCheckpoint(hf_dir) as ckpt:
        for name, tensor in exporter.stream():
            seen.append(name)
            expected = ckpt.read(name).to(device=tensor.device, dtype=dtype)  # the stream's tensors stay on the device
            if tensor.shape != expected.shape or tensor.dtype != expected.dtype or not torch.equal(tensor, expected):
                differ.append(name)
    return seen, differ, exporter.stats.bytes_yielded


def hub_names(hf_dir: str) -> set[str]:
    """The checkpoint's tensor names as on the Hub (transformers-5 fused experts split per expert)."""
    from megatron_bridge.weights.hf_checkpoint import HFCheckpoint

    with HFCheckpoint(hf_dir) as ckpt:
        names = set()
        for name in ckpt.weight_map:
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                projs = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
                prefix = name.rsplit(".", 1)[0]
                names.update(f"{prefix}.{e}.{p}.weight" for e in range(ckpt.shape(name)[0]) for p in projs)
            else:
                names.add(name)
    return names


def run(args: argparse.Namespace) -> dict:
    """The checks on this rank (torch.distributed must be initialised); rank 0's report."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.moe.table import changed_slots, merge_records, routing_change
    from megatron_bridge.runtime.actor import MegatronActor, initialize_parallel
    from megatron_bridge.runtime.model import BuildOptions
    from megatron_bridge.runtime.platform import active

    platform = active()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    spec, train = check_layout(args, world, platform.name)
    dtype = args.dtype or ("fp32" if platform.name == "cpu" else "bf16")
    tol = args.tol if args.tol is not None else DEFAULT_TOLERANCE[dtype]
    routing_tol = args.routing_tol if args.routing_tol is not None else DEFAULT_ROUTING_TOLERANCE[dtype]

    initialize_parallel(train)
    actor = MegatronActor(spec, train, BuildOptions(params_dtype=DTYPES[dtype]), None, platform.name)
    mismatched: list[str] = []
    if args.backend == "mbridge":
        from megatron_bridge.weights.mbridge_backend import load_with_mbridge

        mismatched = load_with_mbridge(actor.chunks, spec, args.hf_dir)
        bytes_read = 0  # mbridge reads on one rank per TP group and scatters
    else:
        bytes_read = actor.load_hf(args.hf_dir).bytes_read
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    input_ids = random_batch(spec, args, dp_size)
    mine = input_ids[dp_rank * args.batch : (dp_rank + 1) * args.batch]
    log_probs, routing = sharded_log_probs(actor, whole_sequence_batch(mine))
    trip = round_trip(actor.chunks, spec, args.hf_dir, DTYPES[dtype])

    # Every DP replica's log-probs and routing, and every rank's bytes read and held, to rank 0.
    held = sum(p.numel() * p.element_size() for chunk in actor.chunks for p in chunk.parameters())
    distinct = ps.get_tensor_model_parallel_rank() == 0 or train.sequence_parallel
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (dp_rank, log_probs, bytes_read, held, mismatched, trip, routing, distinct))
    report = {"layout": vars(args) | {"world_size": world, "dtype": dtype}, "tolerance": tol, "routing_tolerance": routing_tol}
    ok = True
    if rank == 0:
        by_dp = {g[0]: g[1] for g in gathered}
        disagree = sorted({name for g in gathered for name in g[4]})
        sharded = torch.cat([by_dp[dp] for dp in range(dp_size)])
        ref_log_probs, ref_routing = reference(args.hf_dir, input_ids)
        delta = (sharded - ref_log_probs).abs()
        rows_of = [torch.arange(args.batch) + g[0] * args.batch for g in gathered]
        merged = merge_records([g[6] for g in gathered], rows_of, [g[7] for g in gathered], args.seq_len,
                               spec.num_layers, spec.moe_topk).routing
        routes = routing_change(ref_routing, merged, torch.ones(input_ids.shape, dtype=torch.bool), "routing")
        # The log-prob of token t+1 is read at position t: where the experts there differ in some
        # layer (bf16 near-ties), the two models compute different functions, not a rounding apart.
        alike = (changed_slots(ref_routing.long(), merged.long()) == 0).all(-1)[:, :-1]
        delta_alike = delta[alike]
        received = {name for g in gathered for name in g[5][0]}
        expected = hub_names(args.hf_dir)
        differ = sorted({name for g in gathered for name in g[5][1]})
        missing, extra = sorted(expected - received), sorted(received - expected)
        trip_ok = not (differ or missing or extra)
        routing_ok = routes["routing/slot_frac"] <= routing_tol and routes["routing/tokens"] == input_ids.numel()
        delta_ok = bool(delta_alike.numel() and delta_alike.max() <= tol)
        ok = delta_ok and not disagree and trip_ok and routing_ok
        report.update(
            max_abs_delta_log_prob=float(delta_alike.max()) if delta_alike.numel() else float("nan"),
            tokens_routed_alike=delta_alike.numel(),
            max_abs_delta_log_prob_all_tokens=float(delta.max()),
            max_abs_log_prob=float(ref_log_probs.abs().max()),
            mean_abs_delta_log_prob=float(delta.mean()),
            tokens=delta.numel(),
            routing={"slot_frac_differs": routes["routing/slot_frac"], "token_any_frac_differs": routes["routing/token_any_frac"],
                     "tokens": int(routes["routing/tokens"]), "passed": routing_ok,
                     "slot_frac_differs_per_layer": [routes[f"routing/slot_frac/layer_{i}"] for i in range(spec.num_layers)]},
            bytes_read_per_rank=[g[2] for g in gathered],
            parameter_bytes_per_rank=[g[3] for g in gathered],
            backend=args.backend,
            mbridge_disagrees_on=disagree,
            round_trip={"bit_exact": trip_ok, "tensors": len(received), "bytes_per_rank": [g[5][2] for g in gathered],
                        "differ": differ[:10], "missing": missing[:10], "extra": extra[:10]},
            passed=ok,
        )
    verdict = torch.tensor([0 if ok else 1], device=actor.device)
    torch.distributed.broadcast(verdict, src=0)
    report["passed"] = not verdict.item()
    return report


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    layout = report["layout"]
    print(f"layout: TP{layout['tp']} PP{layout['pp']} VPP{layout['vpp'] or '-'} EP{layout['ep']} "
          f"ETP{layout['etp'] or layout['tp']} on {layout['world_size']} ranks, {layout['dtype']}")
    print(f"checkpoint bytes read per rank: {report['bytes_read_per_rank']}")
    print(f"parameter bytes held per rank:  {report['parameter_bytes_per_rank']}")
    print(f"max |delta log-prob| vs transformers: {report['max_abs_delta_log_prob']:.3e} over the "
          f"{report['tokens_routed_alike']} of {report['tokens']} tokens routed alike in every layer (tolerance "
          f"{report['tolerance']:g}); all tokens: max {report['max_abs_delta_log_prob_all_tokens']:.3e}, "
          f"mean {report['mean_abs_delta_log_prob']:.3e}")
    r = report["routing"]
    print(f"routing vs transformers' top-k: {r['slot_frac_differs']:.2%} of expert slots differ, {r['token_any_frac_differs']:.2%} "
          f"of tokens in some layer ({r['tokens']} tokens, tolerance {report['routing_tolerance']:.0%})"
          + ("; identical top-k sets in every layer" if r["slot_frac_differs"] == 0 else ""))
    if report["backend"] == "mbridge":
        disagree = report["mbridge_disagrees_on"]
        print(f"mbridge vs built-in loader: {'identical' if not disagree else f'{len(disagree)} tensors differ, e.g. {disagree[:3]}'}")
    trip = report["round_trip"]
    if trip["bit_exact"]:
        print(f"round trip (load -> export stream): all {trip['tensors']} tensors equal the checkpoint bit for bit")
    else:
        print(f"round trip (load -> export stream): FAILED; differ {trip['differ']}, missing {trip['missing']}, "
              f"extra {trip['extra']} (first 10 of each)")
    print("PASS" if report["passed"] else "FAIL")


def minimal_world(args: argparse.Namespace) -> int:
    """Smallest world size both the dense (TP*PP) and the expert (ETP*EP*PP) grids divide."""
    etp = args.etp or args.tp
    return math.lcm(args.tp * args.pp, etp * args.ep * args.pp)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the layout here, then run this module under torchrun on this node."""
    from megatron_bridge.runtime import platform

    nproc = args.nproc_per_node or minimal_world(args)
    try:
        check_layout(args, nproc, args.platform or platform.detect())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        status_file = os.path.join(tmp, "status")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "megatron_bridge.verify", *argv]
        returncode = subprocess.run(cmd, env={**os.environ, STATUS_FILE_ENV: status_file}).returncode
        if os.path.exists(status_file):
            with open(status_file) as f:
                return int(f.read())
    return returncode or 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return launch(args, argv)
    status = run_rank(args)
    if os.environ.get(STATUS_FILE_ENV) and int(os.environ["RANK"]) == 0:
        with open(os.environ[STATUS_FILE_ENV], "w") as f:
            f.write(str(status))
    return status


def run_rank(args: argparse.Namespace) -> int:
    """This rank's part of the check, as an exit status."""
    from megatron_bridge.runtime import platform

    try:
        active = platform.activate(args.platform)
        platform.init_distributed(active)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank = torch.distributed.get_rank()
    try:
        report = run(args)
    except ConfigError as e:  # raised alike on every rank: the layout and the loader agree first
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.distributed.destroy_process_group()
    if rank == 0:
        _print(report, args.json)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
