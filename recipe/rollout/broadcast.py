"""Weight sync across processes: the training ranks' export stream to a rollout pool of its own
(``actor_rollout_ref.hybrid_engine=false``).

Training rank 0 and the rollout ranks form a process group of their own, outside the training
ranks' torch.distributed world (megatron's parallel state owns that one): a ``TCPStore`` that
training rank 0 hosts and a gloo group on it. Every training rank runs
``WeightExporter.stream()`` as in the colocated sync (its exchanges are collectives of the training
ranks); with ``Routing(receivers=1)`` only rank 0 is given tensors. Rank 0 packs each of the
exporter's buckets into one flat buffer and broadcasts it; every rollout rank receives it into the
same layout (``TransferPlan``, sent once at start-up) and hands views of it to its engine's
``load_weights``, which copies each before pulling the next (the stream's contract). One bucket is in
flight at a time, so neither side holds more than one bucket beyond its model.

Every operation of the group (joining it, each bucket's broadcast) waits at most
``async_training.weight_sync_timeout_s`` for its peers; a peer that died or stalled fails it as a
``WeightSyncError`` of one line, never a hang. So it is on gloo; the watchdogs of NCCL / HCCL may
end the process instead, which the driver reports as a worker that died.

The group's library follows the device (``BACKENDS``, ``async_training.weight_sync_backend=auto``):
gloo with host buffers on the CPU; on GPUs / NPUs NCCL / HCCL with the buffers on the device, so a
bucket goes from the trainer's device to the engines' without a copy through host memory. Their
process groups are built alike from the store: torch's ``ProcessGroupNCCL(store, rank, size,
timeout)``, and torch_npu's ``torch.distributed.ProcessGroupHCCL(store, rank, size, timeout)``
(registered when torch_npu is imported; its API docs). ``weight_sync_backend=gloo`` keeps gloo
and host buffers on devices too. Only gloo has run (docs/async.md).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_bridge.errors import UserError
from megatron_bridge.weights.export import WeightExporter

SENDER = 0  # training rank 0 is rank 0 of the weight group; rollout rank i is rank i + 1
TIMEOUT_KEY = "async_training.weight_sync_timeout_s"
# the weight group's library per platform with weight_sync_backend=auto, and its process group class
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
GROUPS = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL", "hccl": "ProcessGroupHCCL"}


class WeightSyncError(UserError, RuntimeError):
    """The weight group's transfer failed on this rank: a peer died or did not answer in time."""


@dataclass(frozen=True)
class TransferPlan:
    """What the rollout ranks receive, in order: per bucket, (Hub name, shape) of its tensors."""

    dtype: torch.dtype
    buckets: list[list[tuple[str, tuple[int, ...]]]]

    @classmethod
    def of(cls, exporter: WeightExporter) -> TransferPlan:
        return cls(exporter.dtype, [[(n, tuple(exporter.shapes[n])) for n in b.names] for b in exporter.buckets])

    def numel(self, bucket: list[tuple[str, tuple[int, ...]]]) -> int:
        return sum(math.prod(shape) for _, shape in bucket)

    def buffer(self, device: torch.device) -> torch.Tensor:
        """One flat buffer that holds the largest bucket."""
        return torch.empty(max(self.numel(b) for b in self.buckets), dtype=self.dtype, device=device)


def weight_backend(platform: str, setting: str) -> tuple[str, torch.device]:
    """The weight group's library and where its buffers live, for ``async_training.weight_sync_backend``."""
    if setting == "gloo" or platform == "cpu":
        return "gloo", torch.device("cpu")
    return BACKENDS[platform], torch.device(platform, torch.cuda.current_device())  # torch_npu routes torch.cuda


class WeightGroup:
    """This process's member of the weight group (``rank`` 0: the sender, which hosts the store),
    on ``backend`` with its buffers on ``device`` (``weight_backend``). A sync starts only once the
    rollout ranks are idle (the driver waits for their generation first), so ``timeout_s`` bounds
    the transfer itself and a peer that died or stalled during it."""

    def __init__(self, host: str, port: int, rank: int, size: int, timeout_s: float, backend: str = "gloo",
                 device: torch.device = torch.device("cpu")):
        self.timeout_s, self.backend, self.device = timeout_s, backend, device
        timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, size, rank == SENDER, timeout=timeout)
            group = getattr(dist, GROUPS[backend])  # ProcessGroupHCCL: torch_npu's, set on torch.distributed
            self.group = group(dist.PrefixStore("weights", store), rank, size, timeout)
        except RuntimeError as e:  # the store's host, or a peer, never came
            raise self._failed("joining the weight group", e) from e
        self.store = store  # the sender's store serves the group for its whole life

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = SENDER
        try:
            self.group.broadcast([tensor], options).wait()
        except RuntimeError as e:  # gloo: a peer's connection closed, or no peer within the timeout
            raise self._failed("the broadcast from training rank 0", e) from e

    def _failed(self, what: str, error: RuntimeError) -> WeightSyncError:
        fallback = "" if self.backend == "gloo" else "; async_training.weight_sync_backend=gloo leaves the device library out"
        return WeightSyncError(f"weight sync to the rollout pool over {self.backend} failed in {what}: "
                               f"{_first_line(error)} (each rank waits {TIMEOUT_KEY}={self.timeout_s:g} s for the "
                               f"others: raise it if the export is that slow, else a peer died or stalled{fallback})")


def _first_line(error: Exception) -> str:
    """The error's first line without the "[file.cc:line] " prefix of torch's C++ errors."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0])


def send(exporter: WeightExporter, plan: TransferPlan, group: WeightGroup | None) -> dict[str, float]:
    """Every training rank calls this together; rank 0 (the one with ``group``) broadcasts the
    stream bucket by bucket. ``timing_s/reshard`` with the stream's ``reshard/*`` counts, and on
    rank 0 the bytes broadcast and their rate."""
    start = time.perf_counter()
    stream = exporter.stream()
    sent, on_wire = 0, 0.0
    if group is not None:
        flat = plan.buffer(group.device)
        for bucket in plan.buckets:
            offset = 0
            for name, shape in bucket:
                got, tensor = next(stream)
                if got != name:
                    raise RuntimeError(f"weight stream out of the transfer plan's order: {got} where {name} was planned")
                n = math.prod(shape)
                flat[offset : offset + n].copy_(tensor.reshape(-1))
                offset += n
            clock = time.perf_counter()
            group.broadcast(flat[:offset])
            on_wire += time.perf_counter() - clock
            sent += offset * flat.element_size()
    for _ in stream:  # the other ranks' part of the exchanges (rank 0: nothing is left)
        pass
    metrics = {"timing_s/reshard": time.perf_counter() - start, **exporter.stats.as_metrics()}
    if group is not None:
        metrics |= {"reshard/broadcast_bytes": float(sent), "timing_s/reshard_broadcast": on_wire,
                    "reshard/broadcast_gb_per_s": sent / 1e9 / on_wire if on_wire > 0 else 0.0}
    return metrics


def receive(plan: TransferPlan, group: WeightGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """The broadcast as a weight stream for ``load_weights`` (views of one reused buffer)."""
    flat = plan.buffer(group.device)
    for bucket in plan.buckets:
        size = plan.numel(bucket)
        group.broadcast(flat[:size])
        offset = 0
        for name, shape in bucket:
            n = math.prod(shape)
            yield name, flat[offset : offset + n].view(shape)
            offset += n
