"""The driver's side of every worker call: each worker's share out, the results back in the
batch's row order.

Generation is split over the rollout's DP ranks (every rank of a rollout TP group gets its group's
share), on the training workers (colocated) or on the rollout pool's own workers; the Megatron passes over the training DP ranks (``dp_shares`` of the batch contract, every
rank of a DP replica the same rows), and the first rank of each replica answers for it. Routing
records of a pass come back per rank and are merged into one table of the batch's rows.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import ray
import torch

from megatron_bridge.moe.table import RoutingRecord, merge_records
from megatron_bridge.plan.layout import Layout
from megatron_bridge.plan.model_spec import ModelSpec
from megatron_bridge.runtime.batch import INPUT_IDS, RESPONSE_MASK, ROUTED_EXPERTS
from recipe.data.dataset import PromptSample
from recipe.driver.rollouts import Rollout
from recipe.rollout.base import Generation, SamplingParams
from recipe.tracking.metrics import mean_metrics
from recipe.workers.rank import Rank, RankInfo
from recipe.workers.group import DEATH_NOTICE_S, WorkerGroup, any_died, first_failure


@dataclass
class GenerationRequest:
    """A generation batch to send: ``n`` responses per prompt, request ids from ``first_row``."""

    prompts: list[PromptSample]
    n: int
    params: SamplingParams
    first_row: int = 0


@dataclass
class PendingRollout:
    """A generation sent to the rollout ranks and not yet collected (``Dispatch.collect``)."""

    rows: list[PromptSample]
    n: int  # responses per prompt
    refs: list
    key: int  # the generation call's name on the rollout ranks (what a pause keeps there for resume)
    # a resumed generation: each rank's answer at the pause, for the ranks with nothing to continue
    paused: list[tuple[Generation, float]] | None = None


class Dispatch:
    def __init__(self, workers: WorkerGroup, infos: list[RankInfo], layout: Layout, spec: ModelSpec,
                 rollout: WorkerGroup | None = None, sync_timeout_s: float | None = None):
        """``rollout``: the rollout pool's own workers, if it has them (else the training workers
        generate); ``sync_timeout_s``: how long its ranks may take to finish receiving once the
        send has ended (``async_training.weight_sync_timeout_s``)."""
        self.workers, self.infos, self.spec = workers, infos, spec
        self.rollout, self.sync_timeout_s = rollout, sync_timeout_s
        self.generators = rollout or workers
        self.dp_size = infos[0].dp_size
        self.rollout_dp, self.rollout_tp = layout.rollout.dp, layout.rollout.tp
        self.sequence_parallel = layout.train.sequence_parallel
        self.keys = itertools.count()

    def generate(self, prompts: list[PromptSample], n: int, params: SamplingParams, first_row: int = 0) -> Rollout:
        """``n`` responses per prompt. Rows are split into contiguous shares, one per rollout DP
        rank. Each row samples from its own seed, numbered from ``first_row`` (a step's later
        generation batches draw afresh)."""
        return self.collect(self.start_generation([GenerationRequest(prompts, n, params, first_row)])[0])

    def start_generation(self, requests: list[GenerationRequest]) -> list[PendingRollout]:
        """``generate`` for each request, without waiting (a rollout pool of its own generates while
        the trainer works): the ranks run them as one engine call and answer each as soon as its
        responses have ended (``RolloutWorker.run``)."""
        calls: list[list[tuple]] = [[] for _ in range(self.generators.world_size)]
        sent = []
        for request in requests:
            rows = [s for s in request.prompts for _ in range(request.n)]
            shares = _split(len(rows), self.rollout_dp)
            key = next(self.keys)
            for rank, share in enumerate(calls):
                lo, hi = shares[rank // self.rollout_tp]
                ids = list(range(request.first_row + lo, request.first_row + hi))
                share.append(([s.prompt_ids for s in rows[lo:hi]], ids, request.params, key))
            sent.append((rows, request.n, key))
        self.generators.submit(Rank.run, [(share,) for share in calls])
        return [PendingRollout(rows, n, self.generators.submit(Rank.result, [(key,)] * self.generators.world_size), key)
                for rows, n, key in sent]

    @staticmethod
    def done(pending: PendingRollout) -> bool:
        """Every rollout rank has answered the generation (``collect`` would not wait)."""
        ready, _ = ray.wait(pending.refs, num_returns=len(pending.refs), timeout=0)
        return len(ready) == len(pending.refs)

    def pause(self, pending: list[PendingRollout],
              timeout_s: float | None = None) -> list[tuple[Rollout, PendingRollout]]:
        """Partial rollout, until the next weight sync: each generation's responses so far (the one
        running stopped after its current token, those queued behind it held before they start),
        and the generation for ``resume``. The unfinished responses (finish reason "paused" or
        "held") wait in the ranks."""
        self.generators.call(Rank.pause, phase="generation")
        out = []
        for generation in pending:
            answers = self._answers(generation, timeout_s)
            out.append((self._rollout(generation, answers), dataclasses.replace(generation, paused=answers)))
        return out

    def resume(self, paused: PendingRollout) -> PendingRollout:
        """The paused generation continued by the rollout ranks under the weights they hold now;
        ``collect`` gathers every row of it, the continued ones complete or paused again."""
        refs = self.generators.submit(Rank.resume, [(paused.key,)] * self.generators.world_size)
        return dataclasses.replace(paused, refs=refs)

    def collect(self, pending: PendingRollout, timeout_s: float | None = None) -> Rollout:
        """The generation's samples, once every rollout rank has answered; ``WorkerTimeoutError``
        past ``timeout_s``."""
        return self._rollout(pending, self._answers(pending, timeout_s))

    def _answers(self, pending: PendingRollout, timeout_s: float | None) -> list[tuple[Generation, float]]:
        """Each rollout rank's responses and generation seconds, once every one has answered."""
        answers = self.generators.get(pending.refs, "generation", timeout_s)
        if pending.paused is None:
            return answers
        # resumed: a rank that had nothing paused answers None, its rows complete at the pause
        return [(then, 0.0) if now is None else now for now, (then, _) in zip(answers, pending.paused)]

    def _rollout(self, pending: PendingRollout, answers: list[tuple[Generation, float]]) -> Rollout:
        """The ranks' answers as one rollout (the first rank of each rollout TP group answers for it)."""
        response_ids, log_probs, finish, routed, seconds = [], [], [], [], 0.0
        for rank, (out, took) in enumerate(answers):
            seconds = max(seconds, took)
            if rank % self.rollout_tp == 0:
                response_ids += out.token_ids
                log_probs += out.log_probs
                finish += out.finish_reasons
                routed += out.routed_experts or []
        rows = pending.rows
        groups = torch.arange(len(rows) // pending.n).repeat_interleave(pending.n)
        return Rollout(samples=rows, groups=groups, response_ids=response_ids, log_probs=log_probs,
                       finish_reasons=finish, routed_experts=routed if len(routed) == len(rows) else None,
                       gen_seconds=seconds)

    def log_probs(self, batch: dict[str, torch.Tensor], shares: list[torch.Tensor], model: str,
                  replay: bool = False) -> tuple[torch.Tensor, RoutingRecord | None]:
        """Log-probs [rows, R] under the actor or the reference (DP rank d takes rows ``shares[d]``);
        the actor's pass also gives its routing."""
        args = [(self._share(batch, shares, info), model, replay) for info in self.infos]
        outputs = self.workers.call(Rank.compute_log_probs, args, f"{model} log-probs")
        result = torch.empty(len(batch[INPUT_IDS]), batch[RESPONSE_MASK].shape[1], dtype=torch.float32)
        for info, (log_probs, _) in zip(self.infos, outputs):
            if info.first_of_replica:
                result[shares[info.dp_rank]] = log_probs
        if model == "ref":
            return result, None
        return result, self.merge_routing([record for _, record in outputs], shares, batch[INPUT_IDS].shape[1])

    def update(self, batch: dict[str, torch.Tensor], shares: list[torch.Tensor], mini_batch_rows: int,
               replay: bool) -> tuple[dict[str, float], RoutingRecord | None]:
        """The update's metrics, and with ``replay`` what the training forwards replayed."""
        args = [(self._share(batch, shares, info), mini_batch_rows // self.dp_size, replay) for info in self.infos]
        outputs = self.workers.call(Rank.update, args, "actor update")
        per_step = outputs[0][0]
        metrics = mean_metrics(per_step)
        # the LR and skip flag of the last optimizer step, as verl reports them
        metrics["actor/lr"] = per_step[-1]["actor/lr"]
        metrics["actor/skipped"] = float(sum(s["actor/skipped"] for s in per_step))
        replayed = None
        if replay:
            replayed = self.merge_routing([record for _, record in outputs], shares, batch[INPUT_IDS].shape[1])
        return metrics, replayed

    def sample_routing(self, batch: dict[str, torch.Tensor], max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, their routing now): up to ``max_rows`` of the batch's rows, spread over it, routed
        again by the actor."""
        total = len(batch[INPUT_IDS])
        count = max(self.dp_size, min(total, max_rows) // self.dp_size * self.dp_size)
        rows = torch.linspace(0, total - 1, count).round().long()
        shares = list(rows.view(self.dp_size, -1))
        plain = {k: v for k, v in batch.items() if k != ROUTED_EXPERTS}
        records = self.workers.call(Rank.sample_routing, [(self._share(plain, shares, info),) for info in self.infos],
                                    "routing drift pass")
        local = [torch.arange(len(s)) + i * len(shares[0]) for i, s in enumerate(shares)]
        return rows, self.merge_routing(records, local, batch[INPUT_IDS].shape[1]).routing

    def merge_routing(self, records: list, shares: list[torch.Tensor], width: int) -> RoutingRecord:
        """The workers' records of one pass over the rows ``shares[dp rank]``, as one table."""
        return merge_records(records, [shares[info.dp_rank] for info in self.infos],
                             [info.tp_rank == 0 or self.sequence_parallel for info in self.infos], width,
                             self.spec.num_layers, self.spec.moe_topk)

    def sync_weights(self) -> dict[str, float]:
        """Every engine gets the actor's new weights; rank 0's timing and stream counts. A rollout
        pool of its own receives them together with the training ranks' send, and the side that
        fails first is reported, but a rollout rank that died is named even where the send failed
        first (its closed sockets end the send before Ray reports the death); one that stalls
        (stopped, hung) fails the send after ``async_training.weight_sync_timeout_s``, or, where the
        sent bytes fit in the sockets' buffers and the send ends, is named after that long."""
        if self.rollout is None:
            return self.workers.call(Rank.sync_weights, phase="weight sync")[0]
        sending = self.workers.submit(Rank.sync_weights)
        receiving = self.rollout.submit(Rank.sync_weights)
        first = first_failure(receiving + sending, until=sending)
        # a rollout rank that died closes its sockets: the send may fail before Ray reports the death
        if first in receiving or (first is not None and any_died(receiving, DEATH_NOTICE_S)):
            self.rollout.get(receiving, "weight sync", self.sync_timeout_s)  # raises, naming the rank
        sent = self.workers.get(sending, "weight sync")  # raises the send's error, naming its rank
        self.rollout.get(receiving, "weight sync", self.sync_timeout_s)
        return sent[0]

    def connect_rollout(self) -> None:
        """Open the weight group of training rank 0 and the rollout pool's ranks (both ends at once:
        joining waits for every member), and give the engines the actor's weights."""
        trainer = self.workers.workers[0]
        plan, (host, port) = self.workers.get([trainer.transfer_plan.remote(), trainer.address.remote()], "start-up")
        size = 1 + self.rollout.world_size
        joining = [trainer.join_weights.remote(host, port, size)]
        self.rollout.get([w.join_weights.remote(host, port, size, plan) for w in self.rollout.workers], "start-up")
        self.workers.get(joining, "start-up")
        self.sync_weights()

    def memory(self) -> dict[str, float]:
        """The busiest worker's peak memory, and what offload moved."""
        out: dict[str, float] = {}
        for memory in self.workers.call(Rank.memory):
            for key, value in memory.items():
                out[key] = max(out.get(key, 0.0), value)
        return out

    @staticmethod
    def _share(batch: dict[str, torch.Tensor], shares: list[torch.Tensor], info: RankInfo) -> dict[str, torch.Tensor]:
        return {k: v[shares[info.dp_rank]] for k, v in batch.items()}


def _split(rows: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [lo, hi) ranges."""
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
