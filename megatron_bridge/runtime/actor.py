"""A megatron-core actor: this rank's TP/PP/EP shard of a Qwen3-MoE model, its DistributedOptimizer
and LR schedule, and the two passes RL needs: forward-only (old/ref log-probs) and update.

The RL algorithm is not here: both passes take a ``loss_fn`` from ``loss.megatron_hook``, called
as ``loss_fn([norm,] micro_batch, output)``; bound to a micro-batch it is megatron's
``loss_func``. This module owns what makes the passes correct under any parallel layout:
splitting the batch into micro-batches with one padded length, the global normalisation counts,
the pipeline schedule, gradient finalisation, and a step that is skipped when the gradient is not
finite.

Batches follow ``megatron_bridge.runtime.batch`` (this DP rank's rows); every rank of one DP
replica gets the same rows.
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Callable, ContextManager, Iterator

import torch

from loss.megatron_hook import MiniBatchNorm, response_token_index
from megatron_bridge.runtime.batch import (
    CU_SEQLENS,
    HELD_POSITIONS,
    INPUT_IDS,
    POSITION_IDS,
    PACKED_SEQ_PARAMS,
    RESPONSE_ENDS,
    RESPONSE_INDEX,
    RESPONSE_MASK,
    ROW_INDEX,
    SEQUENCE_STARTS,
    response_ends,
)
from megatron_bridge.runtime import context_parallel
from megatron_bridge.runtime.optim import OptimConfig
from megatron_bridge.plan.layout import TrainParallel
from megatron_bridge.weights.load import LoadReport, load_hf_checkpoint
from megatron_bridge.runtime.kernels import optimizer_path, resolve
from megatron_bridge.runtime.megatron_compat import fuse_torch_adam
from megatron_bridge.runtime.model import BuildOptions, build_model_chunks
from megatron_bridge.runtime.offload import HostCopy, training_storages
from megatron_bridge.runtime.platform import to_device
from megatron_bridge.plan.model_spec import ModelSpec

def initialize_parallel(train: TrainParallel, seed: int = 1234) -> None:
    """Megatron's process groups for ``train`` (torch.distributed must be up, platform active); on the
    NPU, MindSpeed's features for ``train`` first (before the groups, which its CP wraps, and before
    any TransformerConfig, which copies its arguments when built)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_bridge.runtime.platform import active

    if active().name == "npu":
        from megatron_bridge.runtime import mindspeed

        mindspeed.apply(train)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=train.tp,
            pipeline_model_parallel_size=train.pp,
            virtual_pipeline_model_parallel_size=train.vpp,
            context_parallel_size=train.cp,
            expert_model_parallel_size=train.ep,
            expert_tensor_parallel_size=train.etp,
        )
    model_parallel_cuda_manual_seed(seed)


def split_rows(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    rows = len(batch[INPUT_IDS])
    if rows % size:
        raise ValueError(f"{rows} rows do not split into batches of {size}")
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


class MegatronActor:
    """This rank's shard of the model with its optimizer. Call ``initialize_parallel`` first."""

    def __init__(self, spec: ModelSpec, train: TrainParallel, options: BuildOptions, optim: OptimConfig | None,
                 platform_name: str, pack: bool = False):
        """``pack``: each micro-batch's sequences back to back without padding (verl's
        ``use_remove_padding``), where the attention takes packed sequences (``packs``)."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        self.spec, self.train, self.optim_config = spec, train, optim
        # Batches arrive on the host; tensors that take part in collectives must be on the device.
        self.device = torch.device("cpu") if platform_name == "cpu" else torch.device(
            platform_name, torch.cuda.current_device())
        self.kernels = resolve(train, platform_name)
        self.packs = pack and train.flash_attn  # megatron's DotProductAttention cannot keep packed sequences apart
        if platform_name == "npu":  # initialize_parallel applied MindSpeed's features for these switches
            from megatron_bridge.runtime import mindspeed

            mindspeed.check_applied(train, self.packs, dispatcher=options.dispatcher or "alltoall")
        self.config, chunks = build_model_chunks(spec, train, options, platform_name)
        self.config.finalize_model_grads_func = finalize_model_grads
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=train.use_distributed_optimizer
        )
        # Only the first chunk buckets its gradients (as megatron's training loop does).
        self.chunks = [
            DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        if optim is None:  # a reference model never runs backward: no fp32 grad buffers (2x its bf16 weights)
            for chunk in self.chunks:
                for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                    buffer.grad_data.untyped_storage().resize_(0)
        self.dp_size = ps.get_data_parallel_world_size()
        self.optimizer = self.scheduler = None
        self.optimizer_path = "none"  # what steps the optimizer, in words (build_optimizer)
        self.steps = 0
        self.host_copy = HostCopy(self.device)
        # entered around each micro-batch's model call, with the micro-batch and its padded length
        # (routing capture and replay: a router call outside it is activation recompute)
        self.forward_context: Callable[[dict, int], ContextManager] = lambda micro_batch, seq_len: contextlib.nullcontext()

    # --- weights ---------------------------------------------------------------------------

    def load_hf(self, directory: str) -> LoadReport:
        """Load a HF checkpoint into the shards; builds the optimizer afterwards (it copies the
        weights into its fp32 state when built)."""
        report = load_hf_checkpoint(self.chunks, self.spec, directory)
        self.build_optimizer()
        return report

    def build_optimizer(self) -> None:
        """The optimizer and its LR schedule over the weights as they are (``load_hf`` builds them
        after loading; without an OptimConfig, none)."""
        if self.optim_config is None or self.optimizer is not None:
            return
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.optim_config
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                bf16=self.config.params_dtype == torch.bfloat16, params_dtype=self.config.params_dtype,
                use_distributed_optimizer=self.train.use_distributed_optimizer,
            ),
            self.chunks,
        )
        inner = [o.optimizer for o in _optimizers(self.optimizer)]
        for torch_optimizer in inner:
            fuse_torch_adam(torch_optimizer)
        self.optimizer_path = optimizer_path(inner)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_steps,
            # megatron requires decay steps > warmup steps even for a constant LR.
            lr_decay_steps=o.lr_decay_steps or o.lr_warmup_steps + 1, lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
        )

    # --- offload ---------------------------------------------------------------------------

    def offload(self, params: bool, grads: bool, optimizer: bool) -> dict[str, float]:
        """Free the chosen training state on the device (``megatron_bridge.runtime.offload``):
        params and optimizer state are copied to the host, grads freed. Returns the bytes freed
        per kind ("params", "grads", "optimizer") and "seconds"."""
        storages = training_storages(self.chunks, _optimizers(self.optimizer), self.device)
        wanted = {"params": params, "grads": grads, "optimizer": optimizer}
        return self.host_copy.offload({kind: s for kind, s in storages.items() if wanted[kind]})

    def onload(self) -> dict[str, float]:
        """Everything ``offload`` freed back on the device, bit for bit (grads zeroed)."""
        return self.host_copy.onload()

    def _require_on_device(self) -> None:
        if self.host_copy.away:
            raise RuntimeError(f"the actor's {', '.join(self.host_copy.away)} are offloaded to the host: "
                               "call onload() first")

    # --- passes ----------------------------------------------------------------------------

    def micro_batches(self, batch: dict[str, torch.Tensor], micro_batch_size: int,
                       max_tokens: int | None = None) -> list[dict[str, torch.Tensor]]:
        """The batch's rows as micro-batches, each padded to one length rounded up to a multiple of
        TP (sequence parallel splits it; with context parallel, of ``TrainParallel.seq_multiple``):
        ``micro_batch_size`` rows each, all padded to the
        longest sequence; or, with a token budget ``max_tokens``, rows of similar length together,
        each micro-batch padded to its own longest (``token_budget_runs``). Every rank cuts alike
        (the lengths are maxed over all ranks first): a micro-batch must have the same shape on
        every rank for the allgather dispatcher's equal-size gathers and the pipeline's p2p.
        Packed (``packs``), a micro-batch's rows go back to back up to their response ends in one
        sequence, padded at its end only (with context parallel each row to a multiple of 2 x CP),
        and a token budget counts their tokens.

        The cutting runs on the host, where reading a length costs nothing (on a GPU each read of a
        device value waits for the device), and each micro-batch goes up whole, with the indices the
        loss needs (``_shipped``): one round trip through the device in all, for the lengths of the
        other ranks."""
        self._require_on_device()
        batch = {k: v.cpu() for k, v in batch.items()}
        ends = response_ends(batch)
        lengths_of_rows = self._packed_sizes(ends) if self.packs else ends.clamp(min=1)
        multiple = self.train.seq_multiple
        if max_tokens is None:
            length = self._over_ranks(lengths_of_rows.max().reshape(1), torch.distributed.ReduceOp.MAX)
            rows = torch.arange(len(lengths_of_rows))
            groups = [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
            if len(rows) % micro_batch_size:
                raise ValueError(f"{len(rows)} rows do not split into batches of {micro_batch_size}")
            lengths = [int(length)] * len(groups)
        else:
            if self.train.pp > 1 and not self.config.variable_seq_lengths:
                raise ValueError("a token budget cuts micro-batches of different lengths, which the pipeline's p2p "
                                 "cannot send with this MoE dispatcher (megatron's variable_seq_lengths is off for "
                                 "allgather): use pipeline_model_parallel_size=1 or micro-batches by rows")
            order = torch.argsort(lengths_of_rows, descending=True, stable=True)
            longest = self._over_ranks(lengths_of_rows[order], torch.distributed.ReduceOp.MAX)
            # the interleaved schedule takes micro-batches in groups of PP
            runs = token_budget_runs(longest.tolist(), max_tokens, multiple, self.train.pp if self.train.vpp else 1,
                                     packed=self.packs)
            groups = [order[start:end] for start, end in runs]
            lengths = [int(longest[start]) for start, _ in runs]
        if self.packs:
            cut = self._packed_micro_batches(batch, groups, ends)
        else:
            cut = [_padded(batch, rows, math.ceil(length / multiple) * multiple, ends)
                   for rows, length in zip(groups, lengths)]
        return [self._shipped(mb) for mb in cut]

    def _over_ranks(self, values: torch.Tensor, op, group=None) -> torch.Tensor:
        """Host ``values`` reduced by ``op`` over ``group``'s ranks (default: all), on the host. The
        backend's collectives take the device's tensors: one copy up and one read back, none alone."""
        if torch.distributed.get_world_size(group) == 1:
            return values
        on_device = values.to(self.device)
        torch.distributed.all_reduce(on_device, op=op, group=group)
        return on_device.cpu()

    def _shipped(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A micro-batch cut on the host, on the device, with what is read from its values computed
        here first: the loss's response tokens (``response_token_index``), the positions this CP
        rank holds, and megatron's description of a packed sequence (its longest part a host int)."""
        extra = {RESPONSE_INDEX: response_token_index(micro_batch)}
        if self.train.cp > 1:
            extra[HELD_POSITIONS] = context_parallel.held(micro_batch[INPUT_IDS].shape[1], micro_batch.get(CU_SEQLENS),
                                                          ulysses=context_parallel.ulysses_degree(self.train))
        shipped = {k: to_device(v, self.device) for k, v in {**micro_batch, **extra}.items()}
        if CU_SEQLENS in micro_batch:
            shipped[PACKED_SEQ_PARAMS] = _packed_seq_params(shipped[CU_SEQLENS], micro_batch[CU_SEQLENS])
        return shipped

    def _packed_micro_batches(self, batch: dict[str, torch.Tensor], groups: list[torch.Tensor],
                              ends: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """One packed sequence per group of rows, its length the largest over all ranks (rounded up
        to TP); all of one length when the pipeline cannot send others."""
        sizes = self._packed_sizes(ends)
        totals = self._over_ranks(torch.stack([sizes[rows].sum() for rows in groups]), torch.distributed.ReduceOp.MAX)
        if self.train.pp > 1 and not self.config.variable_seq_lengths:
            totals = totals.max().expand_as(totals)
        multiple = self.train.seq_multiple
        return [_packed(batch, rows, math.ceil(int(total) / multiple) * multiple, ends, sizes[rows])
                for rows, total in zip(groups, totals)]

    def _packed_sizes(self, ends: torch.Tensor) -> torch.Tensor:
        """Each row's tokens in a packed sequence: up to its response end, at least one, and with
        context parallel a multiple of 2 x CP (each sequence splits into 2 x CP chunks)."""
        unit = 2 * self.train.cp if self.train.cp > 1 else 1
        return (ends.clamp(min=1) + unit - 1) // unit * unit

    def _run(self, micro_batches: list, loss_fn: Callable, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator, model):
            mb = next(data_iterator)
            input_ids, positions = mb[INPUT_IDS], mb[POSITION_IDS]
            if HELD_POSITIONS in mb:  # the model sees this rank's positions; the loss reads labels from the whole rows
                input_ids, positions = input_ids[:, mb[HELD_POSITIONS]], positions[:, mb[HELD_POSITIONS]]
            with self.forward_context(mb, mb[INPUT_IDS].shape[1]):
                output = model(input_ids=input_ids, position_ids=positions, attention_mask=None,
                               packed_seq_params=mb.get(PACKED_SEQ_PARAMS))
            return output, partial(loss_fn, mb)

        iterators = [iter(micro_batches) for _ in self.chunks]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(self.chunks) > 1 else iterators[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(micro_batches),
            # the p2p shapes; micro-batches of other lengths need config.variable_seq_lengths
            seq_length=max(mb[INPUT_IDS].shape[1] for mb in micro_batches),
            micro_batch_size=len(micro_batches[0][INPUT_IDS]),
            forward_only=forward_only,
        )

    def forward_only(self, batch: dict[str, torch.Tensor], micro_batch_size: int, loss_fn: Callable,
                     max_tokens: int | None = None) -> dict[str, torch.Tensor]:
        """Run the model without gradients; ``loss_fn(micro_batch, output)`` returns (loss, dict of
        [b, ...] tensors), e.g. ``partial(loss.megatron_hook.log_prob_func, temperature, False)``.
        Micro-batches of ``micro_batch_size`` rows, or by the token budget ``max_tokens``
        (``micro_batches``). Returns the tensors in the batch's row order, on every rank (sent
        from the last pipeline stage)."""
        from megatron.core import parallel_state as ps

        for chunk in self.chunks:
            chunk.eval()
        micro_batches = self.micro_batches(batch, micro_batch_size, max_tokens)
        with torch.no_grad():
            outputs = self._run(micro_batches, loss_fn, forward_only=True)
        for chunk in self.chunks:
            chunk.train()
        result = {}
        if outputs:  # the last stage's, in micro-batch order: back to row order
            order = torch.argsort(torch.cat([mb[ROW_INDEX] for mb in micro_batches]))
            result = {k: torch.cat([o[k] for o in outputs])[order] for k in outputs[0]}
        return _from_last_stage(result, self.device) if ps.get_pipeline_model_parallel_world_size() > 1 else result

    def train_step(self, batch: dict[str, torch.Tensor], micro_batch_size: int, loss_fn: Callable,
                   max_tokens: int | None = None) -> dict[str, float]:
        """One optimizer step on ``batch`` (this DP rank's share of one mini-batch), in micro-batches
        of ``micro_batch_size`` rows or by the token budget ``max_tokens``.

        ``loss_fn(norm, micro_batch, output)`` returns (loss, metrics), e.g.
        ``partial(loss.megatron_hook.policy_loss_func, cfg)``; its metrics (0-dim tensors) must
        add up over micro-batches and DP ranks. A non-finite loss or gradient norm
        skips the step and leaves the weights as they were (``actor/skipped`` = 1).
        """
        from megatron.core import parallel_state as ps

        if self.optimizer is None:
            raise RuntimeError("no optimizer: build with an OptimConfig (a reference model does not train) and load "
                               "weights with load_hf() first")
        micro_batches = self.micro_batches(batch, micro_batch_size, max_tokens)
        mask = batch[RESPONSE_MASK].cpu().bool()
        counts = torch.stack([mask.sum(), mask.any(dim=1).sum()]).long()
        tokens, rows = self._over_ranks(counts, torch.distributed.ReduceOp.SUM, ps.get_data_parallel_group()).tolist()
        norm = MiniBatchNorm(dp_size=self.dp_size, num_microbatches=len(micro_batches), batch_num_tokens=tokens,
                             global_batch_size=rows)

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro_batches, partial(loss_fn, norm), forward_only=False)
        metrics = _sum_metrics(outputs)
        metrics = _from_last_stage(metrics, self.device) if ps.get_pipeline_model_parallel_world_size() > 1 else metrics
        # One all-reduce for all metrics: each is a sum over DP ranks.
        values = torch.stack(list(metrics.values())) if metrics else torch.zeros(0, device=self.device)
        torch.distributed.all_reduce(values, group=ps.get_data_parallel_group())
        result = dict(zip(metrics, values.tolist()))  # one read-back for all (a float() each waited each time)
        result.update(self.optimizer_step(loss_finite=all(math.isfinite(v) for v in result.values())))
        return result

    def optimizer_step(self, loss_finite: bool = True) -> dict[str, float]:
        """megatron's ``optimizer.step()`` on the gradients in the buffers, split where a bad
        gradient (or ``loss_finite`` False) can still be refused."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        lr = self.scheduler.get_lr(self.optimizer.param_groups[0])
        if not (loss_finite and math.isfinite(grad_norm)):
            return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/skipped": 1.0}
        # The schedule counts from 1, so the first step already uses lr / warmup_steps.
        self.scheduler.step(increment=1)
        lr = self.scheduler.get_lr(self.optimizer.param_groups[0])
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if opt.config.clip_grad > 0 and not getattr(opt, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(opt.get_parameters(), max_norm=opt.config.clip_grad, total_norm=grad_norm)
        self.optimizer.step_with_ready_grads()
        self.steps += 1
        return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/skipped": 0.0}

    def update(self, batch: dict[str, torch.Tensor], mini_batch_size: int, micro_batch_size: int, epochs: int,
               loss_fn: Callable, max_tokens: int | None = None) -> list[dict[str, float]]:
        """PPO epochs over mini-batches of ``mini_batch_size`` rows (this DP rank's share): one
        optimizer step each. Returns the metrics of every step."""
        return [
            self.train_step(mini, micro_batch_size, loss_fn, max_tokens)
            for _ in range(epochs)
            for mini in split_rows(batch, mini_batch_size)
        ]


def token_budget_runs(lengths: list[int], max_tokens: int, multiple: int, runs_multiple_of: int = 1,
                      packed: bool = False) -> list[tuple[int, int]]:
    """Micro-batches by token budget: [start, end) runs of ``lengths`` (sorted longest first), each
    as long as its padded size (rows x its first length rounded up to ``multiple``; ``packed``:
    the sum of its lengths rounded up) fits ``max_tokens``. Sorted rows put similar lengths
    together, so each micro-batch pads little.
    The number of runs is made a multiple of ``runs_multiple_of`` when there are rows enough, by
    halving the runs with the most rows (megatron-core 0.12.1's interleaved schedule takes the
    micro-batches in groups of PP and refuses a partial last group)."""
    def padded(n: int) -> int:
        return math.ceil(n / multiple) * multiple

    def size(start: int, end: int) -> int:
        return padded(sum(lengths[start:end])) if packed else (end - start) * padded(lengths[start])

    if padded(lengths[0]) > max_tokens:
        raise ValueError(f"a sequence of {lengths[0]} tokens (padded to {padded(lengths[0])}) does not fit the token "
                         f"budget of {max_tokens}; raise the budget (ppo_max_token_len_per_gpu / "
                         f"log_prob_max_token_len_per_gpu) to at least {padded(lengths[0])}")
    runs, start = [], 0
    while start < len(lengths):
        end = start + 1
        while end < len(lengths) and size(start, end + 1) <= max_tokens:
            end += 1
        runs.append((start, end))
        start = end
    while len(runs) % runs_multiple_of and len(runs) < len(lengths):
        i = max(range(len(runs)), key=lambda r: runs[r][1] - runs[r][0])  # the first of the largest
        start, end = runs[i]
        middle = (start + end + 1) // 2
        runs[i : i + 1] = [(start, middle), (middle, end)]
    return runs


def _padded(batch: dict[str, torch.Tensor], rows: torch.Tensor, seq_len: int, ends: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch's ``rows`` with their tokens cut or right-padded to ``seq_len``, positions, row
    indices and response ends (``ends``: the batch's)."""
    part = {k: v[rows] for k, v in batch.items()}
    ids = part[INPUT_IDS][:, :seq_len]
    if ids.shape[1] < seq_len:
        ids = torch.nn.functional.pad(ids, (0, seq_len - ids.shape[1]))
    positions = torch.arange(seq_len, device=ids.device).expand_as(ids)
    return {**part, INPUT_IDS: ids, POSITION_IDS: positions, ROW_INDEX: rows, RESPONSE_ENDS: ends[rows]}


def _packed(batch: dict[str, torch.Tensor], rows: torch.Tensor, seq_len: int, ends: torch.Tensor,
            sizes: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch's ``rows``, ``sizes`` tokens each (at least up to their response ends), back to
    back in one sequence of ``seq_len`` tokens (zeros after them), each row's positions from 0."""
    part = {k: v[rows] for k, v in batch.items()}
    width = int(sizes.max())
    tokens = part[INPUT_IDS][:, :width]
    if tokens.shape[1] < width:
        tokens = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]))
    span = torch.arange(width, device=sizes.device)
    kept = span < sizes[:, None]
    total = int(sizes.sum())
    ids = part[INPUT_IDS].new_zeros(1, seq_len)
    ids[0, :total] = tokens[kept]
    positions = torch.zeros_like(ids)
    positions[0, :total] = span.expand_as(kept)[kept]
    bounds = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)] + ([sizes.new_tensor([seq_len])] if seq_len > total else []))
    return {**part, INPUT_IDS: ids, POSITION_IDS: positions, ROW_INDEX: rows, RESPONSE_ENDS: ends[rows],
            SEQUENCE_STARTS: bounds[: len(sizes)], CU_SEQLENS: bounds.to(torch.int32)}


def _packed_seq_params(bounds: torch.Tensor, host_bounds: torch.Tensor):
    """megatron's description of a packed micro-batch (``thd``) with the sequence boundaries
    ``bounds`` (``host_bounds``: the same in host memory, for the longest part, and kept as
    ``host_bounds``, a tuple of ints, for the context-parallel attention's loop over the
    sequences, which would otherwise read them back in every layer). Every row's part is already
    padded (to a multiple of 2 x CP under context parallel), so the padded boundaries that TE's
    and MindSpeed's CP attention split by are the boundaries themselves."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((host_bounds[1:] - host_bounds[:-1]).max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
                             cu_seqlens_kv_padded=bounds, max_seqlen_q=longest, max_seqlen_kv=longest)
    params.host_bounds = tuple(host_bounds.tolist())
    return params


def _optimizers(optimizer) -> list:
    """megatron's optimizers behind ``optimizer`` (a ChainedOptimizer holds dense and expert ones)."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if getattr(o, "optimizer", None) is not None]


def _sum_metrics(outputs: list[dict]) -> dict[str, torch.Tensor]:
    if not outputs:
        return {}
    return {k: torch.stack([o[k].detach().float().reshape(()) for o in outputs]).sum() for k in outputs[0]}


def _from_last_stage(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Broadcast the last pipeline stage's tensors to every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    header = [[(k, tuple(v.shape), v.dtype) for k, v in tensors.items()] if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
    torch.distributed.broadcast_object_list(header, src=src, group=group)
    out = {}
    for key, shape, dtype in header[0]:
        tensor = tensors[key].contiguous() if key in tensors else torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(tensor, src=src, group=group)
        out[key] = tensor
    return out
