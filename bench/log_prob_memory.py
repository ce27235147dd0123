#!/usr/bin/env python
"""Memory and time of the per-token log-prob and entropy pass over vocab-parallel logits, forward
and backward: the code it replaced against the chunked one (``loss.vocab_parallel``).

    python bench/log_prob_memory.py                          # CPU: 32,768 and Qwen3's 151,936 vocabulary
    python bench/log_prob_memory.py --device cuda --tokens 4096 8192 16384 32768 --vocab 151936

Each case scores every row of [tokens, vocab] logits (in ``--dtype``, default bf16; one TP rank,
whose shard is the whole vocabulary) at temperature 0.7 and differentiates the log-probs, with the
entropy as a metric only (the default ``entropy_coeff`` 0) or differentiated too. Three ways:

- old: what ``loss/vocab_parallel.py`` did before issue 37 (kept below, verbatim in substance):
  megatron's ``vocab_parallel_cross_entropy`` on a float32 copy of the logits / T, and an entropy
  Function that saves a float32 copy of its own;
- one chunk: ``vocab_parallel_log_probs_and_entropy`` with ``chunk_size=0`` (all rows at once);
- chunked: the same with the default ``chunk_size`` (``chunk_rows`` gives the rows per chunk);
- fused: chunked with ``fused=True`` (verl's ``use_fused_kernels``): each chunk's passes as kernels
  ``torch.compile`` generates. Its peak is counted on CUDA only: ``LiveBytes`` is a dispatch mode,
  under which a compiled graph runs op by op, so it would count the eager chunk's tensors.

The new ways get the logits as a model's output (a non-leaf tensor nothing else holds), so their
gradient is written into the logits' storage, as the loss hook does. "Extra peak" is the most memory
the pass holds at once beyond the logits themselves, the logits' gradient included, as a multiple of
the bf16 logits (2 bytes x tokens x vocab): on CUDA ``torch.cuda.max_memory_allocated`` less what
was allocated before; on the CPU, which has no such counter, ``LiveBytes`` (below) counts every
tensor storage created during the pass from its creation to its release. Time: the median of
``--repeats`` forward+backward passes after one warm-up, timed without the counter.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: bench/ is on sys.path, the packages are not
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from bench.common import check_out, command_line, cpu_cores, machine_facts, publish, run_ranks, synchronize  # noqa: E402

SCRIPT = "bench/log_prob_memory.py"
TEMPERATURE = 0.7
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WAYS = ("old", "one chunk", "chunked", "fused")
NOT_COUNTED = "—"  # the fused way's peak on the CPU (see above)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive at once among the storages created inside the block.

    Every op's outputs are seen at dispatch (autograd's backward ops on the CPU too: the engine
    runs them on the calling thread, under this mode); an output whose storage is new (not one of
    the op's inputs': an in-place op or a view) is counted from then until a weakref finaliser on
    its storage sees it freed. Deterministic, but blind to memory a kernel allocates for itself.
    Storages that existed before the block (the inputs) are not counted: ``peak`` is the extra.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._counted.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._counted:
                continue
            self._counted.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


# --- the code issue 37 replaced (loss/vocab_parallel.py before it), the baseline ----------------
def _old_scaled_fp32_copy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return scaled.div_(temperature) if temperature != 1.0 else scaled


class _OldEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        from megatron.core import parallel_state

        group, size = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size()
        shifted = _old_scaled_fp32_copy(logits, temperature)
        z_max = shifted.amax(dim=-1)
        if size > 1:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        shifted.sub_(z_max.unsqueeze(-1))
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), exp.mul_(shifted).sum(dim=-1)])
        del exp
        if size > 1:
            dist.all_reduce(sums, group=group)
        sum_exp, sum_exp_z = sums.unbind(0)
        log_sum_exp = sum_exp.log()
        mean_z = sum_exp_z / sum_exp
        ctx.save_for_backward(shifted, log_sum_exp, mean_z)
        ctx.temperature, ctx.input_dtype = temperature, logits.dtype
        return log_sum_exp - mean_z

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        shifted, log_sum_exp, mean_z = ctx.saved_tensors
        probs = (shifted - log_sum_exp.unsqueeze(-1)).exp_()
        grad = (shifted - mean_z.unsqueeze(-1)).mul_(probs)
        del probs
        grad.mul_((grad_entropy / -ctx.temperature).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None


def old_way(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As the loss hook did: megatron's cross entropy, then the entropy (without a graph when only a metric)."""
    from megatron.core import tensor_parallel

    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(_old_scaled_fp32_copy(logits, TEMPERATURE), targets)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        entropy = _OldEntropy.apply(logits, TEMPERATURE)
    return log_probs, entropy


def new_way(chunk_size: int, fused: bool = False) -> Callable:
    def way(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from loss.vocab_parallel import vocab_parallel_log_probs_and_entropy

        positions = torch.arange(len(targets), device=logits.device)
        return vocab_parallel_log_probs_and_entropy(logits, positions, targets, TEMPERATURE, True, chunk_size,
                                                    reuse_logits=True, fused=fused)

    return way


def forward_backward(way: Callable, logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool) -> torch.Tensor:
    """The logits' gradient of sum(log-probs) (+ sum(entropy) when it is differentiated)."""
    log_probs, entropy = way(logits, targets, entropy_grad)
    loss = log_probs.sum() + (entropy.sum() if entropy_grad else 0.0)
    (grad,) = torch.autograd.grad(loss, logits)
    return grad


def _model_output(values: torch.Tensor) -> torch.Tensor:
    # A non-leaf tensor that only the caller holds, as megatron hands the model's output over.
    return values + torch.zeros((), dtype=values.dtype, device=values.device, requires_grad=True)


def extra_peak(way: Callable, values: torch.Tensor, targets: torch.Tensor, entropy_grad: bool) -> int | None:
    """Bytes held at the peak of one forward+backward beyond the logits; None: out of memory."""
    logits = _model_output(values)
    try:
        if values.is_cuda:
            synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            grad = forward_backward(way, logits, targets, entropy_grad)
            synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            with LiveBytes() as counter:
                grad = forward_backward(way, logits, targets, entropy_grad)
            peak = counter.peak
    except torch.OutOfMemoryError:
        return None
    del grad
    return peak


def seconds(way: Callable, values: torch.Tensor, targets: torch.Tensor, entropy_grad: bool, repeats: int) -> float | None:
    times = []
    try:
        for _ in range(repeats + 1):  # the first is a warm-up
            logits = _model_output(values)
            synchronize()
            start = time.perf_counter()
            forward_backward(way, logits, targets, entropy_grad)
            synchronize()
            times.append(time.perf_counter() - start)
            del logits
    except torch.OutOfMemoryError:
        return None
    return statistics.median(times[1:])


def measure(rank: int, cases: list[tuple[int, int]], device: str, dtype: str, repeats: int, seed: int) -> list[dict[str, Any]]:
    """Every case on this rank (torch.distributed and the platform are up; world size 1)."""
    from megatron.core import parallel_state

    from loss.vocab_parallel import DEFAULT_CHUNK_SIZE, chunk_rows

    parallel_state.initialize_model_parallel()
    device = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu"
    ways = {"old": old_way, "one chunk": new_way(0), "chunked": new_way(DEFAULT_CHUNK_SIZE),
            "fused": new_way(DEFAULT_CHUNK_SIZE, fused=True)}
    results = []
    for tokens, vocab in cases:
        g = torch.Generator(device=device).manual_seed(seed)
        values = (3 * torch.randn(tokens, vocab, generator=g, device=device)).to(DTYPES[dtype])
        targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
        for entropy_grad in (False, True):
            row = {"tokens": tokens, "vocab": vocab, "entropy_grad": entropy_grad,
                   "chunk_rows": chunk_rows(tokens, tokens), "peak": {}, "seconds": {}}
            for name, way in ways.items():
                counted = device != "cpu" or name != "fused"
                row["peak"][name] = extra_peak(way, values, targets, entropy_grad) if counted else NOT_COUNTED
                row["seconds"][name] = seconds(way, values, targets, entropy_grad, repeats)
            results.append(row)
            print(f"[{tokens} x {vocab}, entropy grad {entropy_grad}] "
                  + ", ".join(f"{n} {_ratio(row['peak'][n], tokens * vocab)}" for n in ways), file=sys.stderr, flush=True)
        del values
    return results


def _ratio(peak: int | str | None, elements: int) -> str:
    if isinstance(peak, str):
        return peak
    return "OOM" if peak is None else f"{peak / (2 * elements):.2f}x"


def _ms(value: float | None) -> str:
    return "OOM" if value is None else f"{1e3 * value:,.0f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| tokens | vocab | bf16 logits | entropy differentiated | rows per chunk | extra peak: old | one chunk "
             "| chunked | fused | fwd+bwd ms: old | one chunk | chunked | fused |",
             "|--:|--:|--:|:-:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        elements = r["tokens"] * r["vocab"]
        lines.append(f"| {r['tokens']:,} | {r['vocab']:,} | {2 * elements / 2**20:,.0f} MiB | "
                     f"{'yes' if r['entropy_grad'] else 'no'} | {r['chunk_rows']:,} | "
                     + " | ".join(_ratio(r["peak"][w], elements) for w in WAYS) + " | "
                     + " | ".join(_ms(r["seconds"][w]) for w in WAYS) + " |")
    return "\n".join(lines)


def report(results: list[dict[str, Any]], command: str, args: argparse.Namespace, load_before: float) -> str:
    counter = ("`torch.cuda.max_memory_allocated`" if args.device == "cuda"
               else "`LiveBytes` (tensor storages created during the pass, counted until freed)")
    return "\n".join([
        f"Command: `{command}`",
        "",
        *machine_facts(f"{torch.get_num_threads()} intra-op threads, one rank", load_before,
                       "cuda" if args.device == "cuda" else "cpu"),
        f"- logits {args.dtype}, one TP rank, temperature {TEMPERATURE}; extra peak beyond the logits (their gradient "
        f"included) as a multiple of the bf16 logits, by {counter}"
        + ("" if args.device == "cuda" else f" ({NOT_COUNTED} for fused: under that counter a compiled graph runs op "
                                            "by op)")
        + f"; time: median of {args.repeats} after a warm-up (the fused way's first call compiles)",
        "",
        table(results),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"python {SCRIPT}",
        description="Extra peak memory and time of the log-prob and entropy pass (forward+backward): the old "
        "full-vocabulary float32 path against the chunked one.",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (default) or cuda (one GPU)")
    p.add_argument("--tokens", nargs="+", type=int, default=None, metavar="N",
                   help="token counts (default: 256 1024 4096 on the CPU, 4096 8192 16384 32768 on CUDA)")
    p.add_argument("--vocab", nargs="+", type=int, default=None, metavar="V",
                   help="vocabulary sizes (default: 32768 151936 on the CPU, 151936 on CUDA); with the CPU's "
                   "default token counts, vocabularies over 100,000 run only up to 1024 tokens")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the logits' dtype (default bf16)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per case; the median is reported (default 3)")
    p.add_argument("--seed", type=int, default=0, help="logits and targets (default 0)")
    p.add_argument("--out", type=Path, default=None, help="markdown file whose generated block to (re)write")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.repeats < 1 or min(args.tokens or [1]) < 1 or min(args.vocab or [1]) < 1:
        p.error("--repeats, --tokens and --vocab must be >= 1")
    check_out(p, args.out, SCRIPT)
    return args


def cases(args: argparse.Namespace) -> list[tuple[int, int]]:
    if args.device == "cuda":
        return [(n, v) for v in args.vocab or [151936] for n in args.tokens or [4096, 8192, 16384, 32768]]
    tokens, vocabs = args.tokens or [256, 1024, 4096], args.vocab or [32768, 151936]
    # The CPU default leaves out the biggest products (minutes each on a few cores).
    return [(n, v) for v in vocabs for n in tokens if args.tokens or v < 100_000 or n <= 1024]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    threads = cpu_cores()
    torch.set_num_threads(threads)
    (results,) = run_ranks(measure, 1, threads, cases(args), args.device, args.dtype, args.repeats, args.seed,
                           platform="cuda" if args.device == "cuda" else "cpu")
    publish(report(results, command_line(SCRIPT, argv), args, load_before), args.out, SCRIPT,
            "Log-prob and entropy memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
