#!/usr/bin/env python
"""The actor's optimizer step on torch's fused Adam kernel against the multi-tensor path megatron
builds by default without TE or Apex: time, temporaries and the rounding between them.

    python bench/adam_step.py --model qwen3_30b_a3b --layers 1 --experts 8 --vocab 4096 --out docs/kernels.md

One rank builds the actor of ``--model`` (as bench/actor_throughput.py does) and reads what its
optimizer steps: the fp32 main parameters of megatron's DistributedOptimizer, by parameter group
(shapes, learning rate, weight decay, betas, eps). Outside megatron, two torch AdamW over tensors of
those shapes, one per path (``foreach=True``: megatron's default; ``fused=True``: what the actor
switches to, ``megatron_compat.fuse_torch_adam``), take the same ``--steps`` steps from the same
random weights and gradients; each step is timed (median after two warm-ups), the temporaries of one
step are counted (CPU: every tensor storage created in the step, ``bench.log_prob_memory.LiveBytes``;
CUDA: the allocator's peak over what was allocated before), and the weights after the last step are
compared.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.actor_throughput import ACTOR_MODELS, build_actor, model_overrides, write_model  # noqa: E402
from bench.common import check_out, command_line, load_before_run, machine_facts, publish, run_ranks, synchronize  # noqa: E402

SCRIPT = "bench/adam_step.py"
PATHS = {"multi-tensor (megatron's default)": {"foreach": True}, "fused (the actor's)": {"fused": True}}
WARMUP = 2


def _groups(rank: int, checkpoint: str, platform_name: str) -> list[dict]:
    """The actor's inner optimizer groups: hyperparameters and the shapes of the tensors stepped."""
    from megatron_bridge.plan.layout import TrainParallel
    from megatron_bridge.runtime.actor import _optimizers, initialize_parallel

    train = TrainParallel()
    initialize_parallel(train)
    actor = build_actor(train, checkpoint, "fp32", platform_name)
    return [{"lr": g["lr"], "weight_decay": g["weight_decay"], "betas": list(g["betas"]), "eps": g["eps"],
             "shapes": [list(p.shape) for p in g["params"]]}
            for o in _optimizers(actor.optimizer) for g in o.optimizer.param_groups if g["params"]]


def _run(groups: list[dict], path: dict, steps: int, device: torch.device) -> dict:
    """``steps`` steps of one path from seeded weights and gradients: each step's seconds, one step's
    temporaries in bytes, the weights after the last."""
    from bench.log_prob_memory import LiveBytes

    generator = torch.Generator(device=device).manual_seed(0)  # on the device: 2 B draws a step on a GPU
    params = [[torch.nn.Parameter(torch.randn(s, generator=generator, device=device)) for s in g["shapes"]]
              for g in groups]
    optimizer = torch.optim.AdamW(
        [{"params": ps, **{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "shapes"}}
         for ps, g in zip(params, groups)], **path)
    flat = [p for ps in params for p in ps]
    seconds, temporaries = [], None
    for step in range(steps):
        for p in flat:
            p.grad = torch.randn(p.shape, generator=generator, device=device).mul_(1e-3)
        synchronize()
        if step == WARMUP:  # the state exists from the first step on: count only the step's own
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                optimizer.step()
                synchronize()
                temporaries = torch.cuda.max_memory_allocated() - before
            else:
                with LiveBytes() as live:
                    optimizer.step()
                temporaries = live.peak
            continue
        start = time.perf_counter()
        optimizer.step()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds[WARMUP:], "temporaries": temporaries, "weights": [p.detach().cpu() for p in flat]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(ACTOR_MODELS), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's; the slice's 2)")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (default: the model's)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's)")
    p.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=20, help="steps per path, the first two untimed (default 20)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: a training rank's)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the actor's, OptimConfig.lr)")
    p.add_argument("--out", type=Path, default=None, help="write the results into this doc's generated block")
    args = p.parse_args(argv)
    if args.steps <= WARMUP + 1:
        p.error(f"--steps must be above {WARMUP + 1}: two warm-up steps and one counting the temporaries come first")
    check_out(p, args.out, SCRIPT)
    load = load_before_run()
    with tempfile.TemporaryDirectory(prefix="adam_step_") as tmp:
        checkpoint = write_model(tmp, args)
        (groups,) = run_ranks(_groups, 1, args.threads, checkpoint, args.platform, platform=args.platform)
    if args.lr is not None:
        groups = [{**g, "lr": args.lr} for g in groups]
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.platform == "cuda" else "cpu")
    runs = {name: _run(groups, path, args.steps, device) for name, path in PATHS.items()}

    numel = sum(torch.Size(s).numel() for g in groups for s in g["shapes"])
    tensors = sum(len(g["shapes"]) for g in groups)
    a, b = runs.values()
    differ = sum(int((x != y).sum()) for x, y in zip(a["weights"], b["weights"]))
    largest = max(float((x - y).abs().max()) for x, y in zip(a["weights"], b["weights"]))
    magnitude = max(float(x.abs().max()) for x in a["weights"])
    cut = ", ".join(f"{key} {value}" for key, value in model_overrides(args).items())
    cut = f", cut: {cut}" if cut else ""
    lines = [f"Command: `{command_line(SCRIPT, argv)}`", "",
             *machine_facts(f"torch.set_num_threads({args.threads})", load, args.platform),
             f"- model: {ACTOR_MODELS[args.model]}{cut}; the actor's optimizer on one rank: {numel:,} fp32 "
             f"main parameters in {tensors} tensors, {len(groups)} parameter groups",
             f"- {args.steps} steps per path from the same weights and gradients (N(0, 1) and N(0, 1e-3)), "
             f"learning rate {groups[0]['lr']:g}{' (--lr)' if args.lr is not None else ' (the actor default)'}; "
             f"time: median of steps {WARMUP + 2}-{args.steps} (step {WARMUP + 1} counts the temporaries)",
             "- temporaries: " + ("the allocator's peak during one step over what was allocated before it"
                                  if args.platform == "cuda" else
                                  "the most bytes alive at once among tensor storages created in one step"), "",
             "| path | step (ms) | range (ms) | temporaries (MiB) | temporaries per main parameter (bytes) |",
             "|---|--:|--:|--:|--:|"]
    for name, run in runs.items():
        ms = [s * 1e3 for s in run["seconds"]]
        lines.append(f"| {name} | {statistics.median(ms):.2f} | {min(ms):.2f}-{max(ms):.2f} | "
                     f"{run['temporaries'] / 2**20:.1f} | {run['temporaries'] / numel:.2f} |")
    lines += ["", f"After {args.steps} steps the two paths' weights differ in {differ:,} of {numel:,} "
              f"({100 * differ / numel:.3g} %), by at most {largest:.3g} (weights up to {magnitude:.3g}; float32's "
              f"spacing there {math.ulp(torch.tensor(magnitude, dtype=torch.float32).item()) * 2 ** 29:.3g})."]
    publish("\n".join(lines), args.out, SCRIPT, "Adam step")


if __name__ == "__main__":
    main()
