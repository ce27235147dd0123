"""Training state off the device while the rollout engine holds it, and back, bit for bit.

Three kinds, each under its layout flag (``param_offload``, ``grad_offload``, ``optimizer_offload``):

- params: the storage of every model parameter. With the distributed optimizer that is the DDP
  buffers' ``param_data`` (each parameter is a view into it), padded as megatron allocates it;
  without it, each parameter's own. Copied to the host.
- grads: the storage of every ``main_grad``, the DDP buffers' fp32 ``grad_data``. Freed, not
  copied: it holds the last step's gradients, which the next ``train_step`` zeroes before its
  first backward, so it comes back zeroed (as verl's offload drops it).
- optimizer: what the inner torch optimizer steps (the fp32 main parameters,
  ``shard_fp32_from_float16_groups`` for a bf16 model) and its state (exp_avg, exp_avg_sq, step)
  where they live on the device, minus storages of the other kinds (an fp32 model's optimizer
  steps views into the param buffer). Copied to the host.

Storages move, not tensors: ``untyped_storage().resize_(0)`` frees the memory under every view
megatron holds (parameters, bucket views, ``main_grad``, optimizer shards, the keys of the
optimizer's state) and ``resize_`` plus a copy refills it in place, so nothing needs re-pointing
(verl's ``offload_megatron_model_to_cpu`` resizes the buffers' storages the same way). The host
copy is a separate tensor on the CPU platform too, where the device storage is really freed: the
mechanism runs and is tested there. On an accelerator the host copies are pinned and kept for the
next offload (pinned allocation is slow, and reuse avoids a second host copy at the peak).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch

KINDS = ("params", "grads", "optimizer")
COPIED = ("params", "optimizer")  # grads are freed and come back zeroed


@dataclass
class _Away:
    """One storage off the device: its size and its host copy (None: freed, not copied)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None


def training_storages(chunks: list, optimizers: list, device: torch.device) -> dict[str, list[torch.UntypedStorage]]:
    """The distinct storages on ``device`` of each kind (see the module doc); ``optimizers`` are
    megatron optimizers with an inner torch optimizer. Storages already freed are left out."""
    params = [p for chunk in chunks for p in chunk.module.parameters()]
    by_kind = {"params": _distinct(params, device),
               "grads": _distinct([p.main_grad for p in params if getattr(p, "main_grad", None) is not None], device)}
    taken = by_kind["params"].keys() | by_kind["grads"].keys()
    optimizer = _distinct(_optimizer_tensors(optimizers), device)
    by_kind["optimizer"] = {ptr: s for ptr, s in optimizer.items() if ptr not in taken}
    return {kind: list(storages.values()) for kind, storages in by_kind.items()}


def _distinct(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, torch.UntypedStorage]:
    out: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device == device and storage.nbytes() > 0:
            out.setdefault(storage.data_ptr(), storage)
    return out


def _optimizer_tensors(optimizers: list) -> Iterable[torch.Tensor]:
    for opt in optimizers:
        inner = opt.optimizer
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))


class HostCopy:
    """What one model has off the device, by kind."""

    def __init__(self, device: torch.device):
        self.device = device
        self.away: dict[str, list[_Away]] = {}
        self.pinned: dict[str, list[torch.Tensor]] = {}  # host buffers kept for the next offload

    def offload(self, storages: dict[str, list[torch.UntypedStorage]]) -> dict[str, float]:
        """Free ``storages`` (kind -> storages) on the device, copying params and optimizer state
        to the host; kinds already away are skipped. Returns the bytes freed per kind and seconds."""
        start = time.perf_counter()
        freed = dict.fromkeys(KINDS, 0)
        for kind, kind_storages in storages.items():
            if kind in self.away or not kind_storages:
                continue
            hosts = self._host_buffers(kind, kind_storages) if kind in COPIED else [None] * len(kind_storages)
            self.away[kind] = [_release(s, h) for s, h in zip(kind_storages, hosts)]
            freed[kind] = sum(a.nbytes for a in self.away[kind])
        if self.device.type != "cpu":
            torch.cuda.empty_cache()  # hand the freed blocks back for the engine (npu: via transfer_to_npu)
        return {**freed, "seconds": time.perf_counter() - start}

    def onload(self) -> dict[str, float]:
        """Every kind back on the device, as it was (grads zeroed). Returns bytes per kind and seconds."""
        start = time.perf_counter()
        restored = dict.fromkeys(KINDS, 0)
        for kind, away in self.away.items():
            for a in away:
                _restore(a)
            restored[kind] = sum(a.nbytes for a in away)
            if self.device.type != "cpu" and kind in COPIED:
                self.pinned[kind] = [a.host for a in away]
        self.away = {}
        return {**restored, "seconds": time.perf_counter() - start}

    def _host_buffers(self, kind: str, storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
        kept = self.pinned.pop(kind, [])
        if [h.numel() for h in kept] == [s.nbytes() for s in storages]:
            return kept
        pin = self.device.type != "cpu"
        return [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin) for s in storages]


def _release(storage: torch.UntypedStorage, host: torch.Tensor | None) -> _Away:
    nbytes = storage.nbytes()
    if host is not None:
        host.untyped_storage().copy_(storage)  # synchronous: done before the storage is freed
    storage.resize_(0)
    return _Away(storage, nbytes, host)


def _restore(away: _Away) -> None:
    away.storage.resize_(away.nbytes)
    if away.host is None:
        away.storage.fill_(0)
    else:
        away.storage.copy_(away.host.untyped_storage())
