"""Megatron shards → a stream of Hugging Face tensors for the rollout engine, bucketed and EP-aware.

``WeightExporter(chunks, spec, routing, bucket_mb, dtype).stream()`` yields ``(hf_name, tensor)``
with the names and shapes of a checkpoint on the Hub (per-expert ``gate_proj``/``up_proj``/
``down_proj``, separate ``q_proj``/``k_proj``/``v_proj``), which is what vLLM's and vLLM-Ascend's
``model.load_weights`` consume. Every rank of the training job calls it together; each rank gets
the tensors its rollout rank needs (``Routing``).

How one sync runs:

1. Plan (once, at construction): every rank lists the HF slices it holds (``local_hf_slices``, the
   inverse of the loader); the lists are exchanged once, so every rank knows who holds each piece
   of each HF tensor (TP/ETP slices, EP experts with global ids, PP layers with global numbers).
   Tensors are cut, in checkpoint order, into buckets of at most ``bucket_mb``.
2. Per bucket: each destination takes the pieces it holds from its own shard and receives the
   others straight from a holder, one message per piece, batched (``batch_isend_irecv``), cast to
   the rollout dtype before sending; senders are picked to spread the bytes. No rank gathers the
   model: a rank holds its shard, one bucket being assembled and the pieces it sends in it.
3. A tensor this rank holds whole, already in the rollout dtype, is yielded as a view of its shard
   without a copy (with EP-aware routing that is most experts).

Yielded tensors may be views into the bucket buffer (reused by the next bucket), or of the live parameters:
the consumer copies them before pulling the next item (every ``load_weights`` does).
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

import torch

from megatron_bridge.weights.hf_mapping import hf_parts, hf_slices, split_parts, to_hf
from megatron_bridge.weights.load import hf_shape, placement, unwrap
from megatron_bridge.plan.model_spec import ModelSpec

Slice = tuple[str, slice | None, slice | None, torch.Tensor]  # (hf_name, rows, cols, values)
Span = tuple[int, int] | None  # [start, stop) of a dim; None: all of it
_EXPERT_ID = re.compile(r"\.mlp\.experts\.(\d+)\.")
_LAYER_ID = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Piece:
    """One slice of one HF tensor, as some training ranks hold it."""

    name: str
    rows: Span
    cols: Span

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece's region of the full tensor."""
        if self.rows is not None:
            tensor = tensor[self.rows[0] : self.rows[1]]
        if self.cols is not None:
            tensor = tensor[:, self.cols[0] : self.cols[1]]
        return tensor


def _span(s: slice | None) -> Span:
    return None if s is None else (s.start, s.stop)


def _local_parts(chunks: list[torch.nn.Module], spec: ModelSpec):
    """(hf_names, [(rows, cols)], convert) per local shard part; ``convert()`` gives the HF slices.
    Conversion is deferred because regrouping QKV copies, and the stream needs one bucket at a time."""
    for chunk in chunks:
        model = unwrap(chunk)
        where = placement(model)
        for name, param in model.named_parameters():
            parts = hf_parts(name, where)
            shards = split_parts(name, param.detach(), len(parts))
            for part, shard in zip(parts, shards, strict=True):
                shapes = [hf_shape(spec, n) for n in part.hf_names]
                yield part.hf_names, hf_slices(part, shapes), (lambda part=part, shard=shard: to_hf(part, shard, spec))


def local_hf_slices(chunks: list[torch.nn.Module], spec: ModelSpec) -> Iterator[Slice]:
    """Every (hf_name, rows, cols, tensor) this rank holds; None rows/cols mean the whole dim.
    Replicated tensors (norms, router) come from every rank that holds them."""
    for names, slices, convert in _local_parts(chunks, spec):
        for hf_name, (rows, cols), tensor in zip(names, slices, convert()):
            yield hf_name, rows, cols, tensor


class _LocalPieces:
    """This rank's pieces by ``Piece``, converted on first use and dropped with ``release``."""

    def __init__(self, chunks: list[torch.nn.Module], spec: ModelSpec):
        self.sources: dict = {}
        for names, slices, convert in _local_parts(chunks, spec):
            for index, (hf_name, (rows, cols)) in enumerate(zip(names, slices)):
                self.sources[Piece(hf_name, _span(rows), _span(cols))] = (convert, index)
        self.cache: dict = {}

    def __contains__(self, piece: "Piece") -> bool:
        return piece in self.sources

    def __getitem__(self, piece: "Piece") -> torch.Tensor:
        convert, index = self.sources[piece]
        if convert not in self.cache:
            self.cache[convert] = convert()
        return self.cache[convert][index]

    def release(self) -> None:
        self.cache.clear()


def checkpoint_order(name: str) -> tuple:
    """Sort key: embedding, layers by number (experts by id), final norm, head, as on the Hub."""
    layer = _LAYER_ID.match(name)
    expert = _EXPERT_ID.search(name)
    group = 0 if "embed_tokens" in name else 1 if layer else 2 if name.startswith("model.") else 3
    return group, int(layer[1]) if layer else 0, int(expert[1]) if expert else -1, name


@dataclass(frozen=True)
class Routing:
    """Which rollout ranks need which tensors. Rollout rank r runs in training rank r's process
    (colocated). With rollout expert parallel (vLLM: EP = TP x DP), rollout rank r owns experts
    [k*E/ep, (k+1)*E/ep) for k = r mod ep and receives only those; dense tensors go to every rank,
    since each rollout rank takes its own TP slice of them in ``load_weights``."""

    world_size: int
    num_experts: int
    expert_parallel: int = 1  # 1: every rank receives every expert
    # the training ranks that receive tensors, the first ones; None: all. A rollout pool of its own
    # takes the whole model from rank 0 (recipe.rollout.broadcast): receivers=1
    receivers: int | None = None

    def __post_init__(self):
        ep = self.expert_parallel
        if ep < 1 or self.num_experts % ep or self.world_size % ep:
            raise ValueError(
                f"rollout expert parallel size {ep} must divide the number of experts ({self.num_experts}) "
                f"and the number of ranks ({self.world_size})"
            )

    def destinations(self, name: str) -> tuple[int, ...]:
        ranks = range(self.world_size if self.receivers is None else self.receivers)
        expert = _EXPERT_ID.search(name)
        if expert is None or self.expert_parallel == 1:
            return tuple(ranks)
        owner = int(expert[1]) // (self.num_experts // self.expert_parallel)
        return tuple(r for r in ranks if r % self.expert_parallel == owner)


@dataclass
class ExportStats:
    """What one ``stream()`` did on this rank."""

    tensors: int = 0  # yielded here
    bytes_yielded: int = 0  # in the rollout dtype
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0  # buckets this rank took part in
    max_bucket_bytes: int = 0  # largest bucket assembled here
    seconds: float = 0.0  # producing the stream, without the consumer's time

    def as_metrics(self) -> dict[str, float]:
        return {
            "reshard/export_s": self.seconds,
            "reshard/tensors": self.tensors,
            "reshard/bytes": self.bytes_yielded,
            "reshard/bytes_sent": self.bytes_sent,
            "reshard/bytes_received": self.bytes_received,
            "reshard/buckets": self.buckets,
        }


@dataclass
class _Bucket:
    names: list[str]
    # (piece, source rank) that this rank must receive, by source; and pieces it sends, by destination
    receives: dict[int, list[Piece]] = field(default_factory=dict)
    sends: dict[int, list[Piece]] = field(default_factory=dict)


class WeightExporter:
    """The plan and the stream for one model's shards; build it on every rank together, once per
    model (the layout does not change), and call ``stream()`` after every update."""

    def __init__(self, chunks: list[torch.nn.Module], spec: ModelSpec, routing: Routing, bucket_mb: float = 512,
                 dtype: torch.dtype = torch.bfloat16):
        self.chunks, self.spec, self.routing, self.dtype = chunks, spec, routing, dtype
        self.bucket_bytes = int(bucket_mb * 2**20)
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket size must be positive, got {bucket_mb} MB")
        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if routing.world_size != world:
            raise ValueError(f"routing is for {routing.world_size} ranks, the job has {world}")
        mine = list(_LocalPieces(chunks, spec).sources)
        everyone = [mine]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
        holders: dict[Piece, list[int]] = defaultdict(list)
        for rank, pieces in enumerate(everyone):
            for piece in pieces:
                holders[piece].append(rank)
        self.pieces: dict[str, list[Piece]] = defaultdict(list)
        for piece in holders:
            self.pieces[piece.name].append(piece)
        self.names = sorted(self.pieces, key=checkpoint_order)
        self.shapes = {n: hf_shape(spec, n) for n in self.names}
        self._check_coverage()
        self.oversized = [n for n in self.names if self._bytes(n) > self.bucket_bytes]
        if self.oversized and self.rank == 0:
            warnings.warn(
                f"{len(self.oversized)} tensors are larger than the {bucket_mb} MB bucket and travel alone "
                f"(largest: {max(self.oversized, key=self._bytes)}, {self._bytes(max(self.oversized, key=self._bytes)) / 2**20:.0f} MB)",
                stacklevel=2,
            )
        self.holders = dict(holders)
        self.buckets = self._plan(holders)
        self.stats = ExportStats()

    def _bytes(self, name: str) -> int:
        return math.prod(self.shapes[name]) * self.dtype.itemsize

    def _check_coverage(self) -> None:
        """Every HF tensor's pieces tile it exactly (a missing shard is a bug, not a silent zero)."""
        for name, pieces in self.pieces.items():
            shape = self.shapes[name]
            area = sum(math.prod(self._piece_shape(p)) for p in pieces)
            if area != math.prod(shape):
                raise RuntimeError(f"export plan: the shards of {name} cover {area} of its {math.prod(shape)} elements")

    def _plan(self, holders: dict[Piece, list[int]]) -> list[_Bucket]:
        """Buckets in checkpoint order; for each, who sends which pieces to whom. Every rank computes
        the same plan from the same exchanged lists."""
        buckets: list[_Bucket] = []
        size = 0
        for name in self.names:
            nbytes = self._bytes(name)
            if not buckets or size + nbytes > self.bucket_bytes:
                buckets.append(_Bucket([]))
                size = 0
            buckets[-1].names.append(name)
            size += nbytes
        load = [0] * self.routing.world_size  # bytes each rank sends, to spread the work
        for bucket in buckets:
            for name in bucket.names:
                for dst in self.routing.destinations(name):
                    for piece in self.pieces[name]:
                        owners = holders[piece]
                        if dst in owners:
                            continue
                        src = min(owners, key=lambda r: (load[r], r))
                        load[src] += math.prod(self._piece_shape(piece))
                        if src == self.rank:
                            bucket.sends.setdefault(dst, []).append(piece)
                        if dst == self.rank:
                            bucket.receives.setdefault(src, []).append(piece)
        return buckets

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) for every tensor this rank's rollout rank needs, in checkpoint order.
        ``self.stats`` describes the pass when the generator is exhausted."""
        self.stats = stats = ExportStats()
        local = _LocalPieces(self.chunks, self.spec)
        wanted = {n for n in self.names if self.rank in self.routing.destinations(n)}
        self._flat = torch.empty(0, dtype=self.dtype)  # one buffer for every bucket of this pass
        clock = time.perf_counter()
        for bucket in self.buckets:
            mine = [n for n in bucket.names if n in wanted]
            if not (mine or bucket.sends or bucket.receives):
                continue
            stats.buckets += 1
            out = self._assemble(bucket, mine, local, stats)
            local.release()
            stats.seconds += time.perf_counter() - clock
            for name in mine:
                stats.tensors += 1
                stats.bytes_yielded += out[name].numel() * out[name].element_size()
                yield name, out[name]
            clock = time.perf_counter()
        self._flat = None
        stats.seconds += time.perf_counter() - clock

    def _assemble(self, bucket: _Bucket, mine: list[str], local: _LocalPieces,
                  stats: ExportStats) -> dict[str, torch.Tensor]:
        """Exchange this bucket's pieces and build the full tensors this rank needs. One message per
        piece, sent from the shard itself when it is contiguous and in the rollout dtype, received
        straight into place when its region is contiguous (rows), so most bytes are never copied."""
        dist = torch.distributed
        out: dict[str, torch.Tensor] = {}
        assembled = []
        for name in mine:  # whole tensors held here in the rollout dtype go out as they are
            whole = Piece(name, None, None)
            if whole in local and local[whole].dtype == self.dtype:
                out[name] = local[whole]
            else:
                assembled.append(name)
        total = sum(math.prod(self.shapes[n]) for n in assembled)
        stats.max_bucket_bytes = max(stats.max_bucket_bytes, total * self.dtype.itemsize)
        if self._flat.numel() < total:
            self._flat = None  # free the smaller buffer before allocating the larger one
            self._flat = torch.empty(total, dtype=self.dtype)
        flat, offset = self._flat, 0
        for name in assembled:
            n = math.prod(self.shapes[name])
            out[name] = flat[offset : offset + n].view(self.shapes[name])
            offset += n

        ops, outgoing, staged = [], {}, []
        for dst, pieces in bucket.sends.items():
            for piece in pieces:
                if piece not in outgoing:  # the same piece for several receivers: convert once
                    outgoing[piece] = local[piece].to(self.dtype).contiguous()
                ops.append(dist.P2POp(dist.isend, outgoing[piece], dst))
                stats.bytes_sent += outgoing[piece].numel() * outgoing[piece].element_size()
        for src, pieces in bucket.receives.items():
            for piece in pieces:
                target = piece.of(out[piece.name])
                buffer = target if target.is_contiguous() else torch.empty(target.shape, dtype=self.dtype)
                if buffer is not target:
                    staged.append((target, buffer))
                ops.append(dist.P2POp(dist.irecv, buffer, src))
                stats.bytes_received += buffer.numel() * buffer.element_size()
        requests = dist.batch_isend_irecv(ops) if ops else []
        for name in assembled:
            for piece in self.pieces[name]:
                if piece in local:
                    piece.of(out[name]).copy_(local[piece])
        for request in requests:
            request.wait()
        for target, buffer in staged:
            target.copy_(buffer)
        return out

    def _piece_shape(self, piece: Piece) -> tuple[int, ...]:
        shape = list(self.shapes[piece.name])
        for dim, span in enumerate((piece.rows, piece.cols)):
            if span is not None:
                shape[dim] = span[1] - span[0]
        return tuple(shape)
