"""What megatron-core 0.12.1 needs without Transformer Engine or Apex, and on torch >= 2.8, on
every platform: the CPU path has neither, and a GPU install may lack both (on an H200 without them
every optimizer step failed before these covers, docs/bench_device.md). Each cover changes nothing
where the installed packages already work: with TE, Apex or MindSpeed's fused optimizer and on
torch 2.7 the original functions run unchanged. One more replaces a loop with one call for packed
micro-batches (``_cover_packed_rope``), with the loop's numbers; one finds the MoE token order
without making the host wait for the device (``_cover_unfused_permute``), with the same order; and
``fuse_torch_adam`` puts megatron's fallback Adam on torch's fused kernel.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

import torch

from megatron_bridge.atomic import replacing
from megatron_bridge.plan.platforms import PLATFORMS

_installed = False


def _cover_fp8_quantize() -> None:
    """``DistributedOptimizer._copy_main_params_to_model_params`` calls ``quantize_param_shard`` on
    every step, and without TE that function raises even when there is no FP8 parameter."""
    from megatron.core.optimizer import distrib_optimizer

    original = distrib_optimizer.quantize_param_shard

    @functools.wraps(original)
    def quantize_param_shard(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    distrib_optimizer.quantize_param_shard = quantize_param_shard


def _cover_torch_writer() -> None:
    """torch >= 2.8 added a required ``serialization_format`` to the private ``_write_item``;
    megatron-core 0.12.1's torch_dist writer calls it with the five arguments of torch 2.7."""
    from torch.distributed.checkpoint import filesystem

    if not hasattr(filesystem, "SerializationFormat"):
        return  # torch 2.7 (the NPU stack): nothing to bridge
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def write_item(*args):
        if len(args) == 5:
            return filesystem._write_item(*args, filesystem.SerializationFormat.TORCH_SAVE)
        return filesystem._write_item(*args)

    filesystem_async._write_item = write_item


def keep_mcore_data(writer_class) -> None:
    """torch 2.11's ``FileSystemWriter.finish`` writes ``dataclasses.replace(metadata, ...)``, a copy
    without the ``mcore_data`` attribute megatron-core 0.12.1's save planner sets on the checkpoint's
    metadata (the original shapes of its flattened optimizer tensors). Such a checkpoint saves but
    does not load: "'Metadata' object has no attribute 'mcore_data'" (the main job's resume on an
    H100 with torch 2.11; torch 2.13 sets the version in place and keeps it). After the writer has
    written the metadata file, put the attribute back where it is missing."""
    original = writer_class.finish

    @functools.wraps(original)
    def finish(self, metadata, results):
        original(self, metadata, results)
        mcore_data = getattr(metadata, "mcore_data", None)
        if mcore_data is None:
            return
        rank = getattr(self, "rank", None)
        name = ".metadata" if getattr(self, "use_collectives", True) or rank is None else f"__{rank}.metadata"
        path = Path(self.path) / name
        with open(path, "rb") as file:
            written = pickle.load(file)
        if getattr(written, "mcore_data", None) is not None:
            return
        written.mcore_data = mcore_data
        with replacing(path, durable=True) as temporary, open(temporary, "wb") as file:
            pickle.dump(written, file)

    writer_class.finish = finish


def _torch_adam(optimizer) -> bool:
    """torch's Adam / AdamW, which megatron falls back to without TE or Apex: it keeps a ``step``
    tensor in each parameter's state, where the fused ones keep it in the param groups."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


# Where torch's Adam has a fused kernel this package steps with (the planner counts no temporaries there).
FUSED_ADAM_DEVICES = tuple(name for name, platform in PLATFORMS.items() if platform.fused_adam)


def fuse_torch_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Step megatron's fallback Adam (torch's, without TE or Apex) with torch's fused kernel where
    every parameter's device has one, instead of megatron's default there, the multi-tensor path,
    which makes whole-shard temporaries (sqrt of every second moment: 4 bytes per fp32 main
    parameter) and many passes over the state. The same update to rounding (a few weights differ in
    their last bit, bench/adam_step.py). Returns whether it did. The fused kernel keeps Adam's
    ``step`` on the parameters' device: ``_adam_step`` below allocates and restores it there."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not (_torch_adam(optimizer) and params and all(p.device.type in FUSED_ADAM_DEVICES for p in params)):
        return False
    for group in [*optimizer.param_groups, optimizer.defaults]:
        group["fused"], group["foreach"] = True, False
    _place_steps(optimizer)  # steps made before (a state loaded by the multi-tensor path)
    return True


def _adam_step(group: dict, param: torch.Tensor, value) -> torch.Tensor:
    """Adam's ``step`` for ``param`` as torch's Adam makes it: on the parameter's device for the
    fused and capturable kernels, a host scalar otherwise; each parameter its own tensor."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.as_tensor(value).to(dtype=torch.float32, device=param.device if on_device else "cpu",
                                     copy=True)


def _place_steps(optimizer: torch.optim.Optimizer) -> None:
    """Every ``step`` the state holds made again by ``_adam_step``: its parameter's own, where the
    group's kernel wants it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:
                state["step"] = _adam_step(group, p, state["step"])


def _cover_adam_state(optimizer_class) -> None:
    """The DistributedOptimizer's state dict with torch's Adam (``megatron_bridge.runtime.checkpoint``)."""

    # `state_dict()` reads Adam's `step` from the state, which does not exist before the first
    # step: a checkpoint is loaded into a fresh optimizer. Allocate it (zeros, step 0) first.
    sharded_state_dict = optimizer_class.sharded_state_dict

    @functools.wraps(sharded_state_dict)
    def allocated_sharded_state_dict(self, *args, **kwargs):
        if _torch_adam(self.optimizer) and not self.optimizer.state:
            self.init_state_fn(self.optimizer, self.config)
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    self.optimizer.state[p]["step"] = _adam_step(group, p, 0.0)
        return sharded_state_dict(self, *args, **kwargs)

    optimizer_class.sharded_state_dict = allocated_sharded_state_dict

    # Loading copies every state tensor from the checkpoint's, but `step` is restored from the
    # param groups (load_state_dict) and not among them: leave it out of the copy.
    set_states = optimizer_class._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_but_step(self, model_param, tensors):
        if not _torch_adam(self.optimizer):
            return set_states(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        set_states(self, model_param, tensors)
        if step is not None:
            state["step"] = step

    optimizer_class._set_main_param_and_optimizer_states = set_states_but_step

    # ... and restores it as one tensor shared by every parameter's state, which torch's Adam then
    # increments in place once per parameter: give each state its own, where the kernel wants it.
    load_state_dict = optimizer_class.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        if _torch_adam(self.optimizer):
            _place_steps(self.optimizer)

    optimizer_class.load_state_dict = load_state_dict_own_steps


def _cover_packed_rope() -> None:
    """megatron-core 0.12.1 rotates a packed (``thd``) micro-batch one sequence at a time, a Python
    loop of small operations per sequence, layer, query and key (on the CPU it doubled a forward of
    32 short rows). The same rotation is one call: each token takes the frequencies of its position
    within its own sequence, the values the loop gives it; with context parallel, the positions
    this rank holds (``context_parallel.held``, the split megatron's loop assumes too)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_bridge.runtime import context_parallel
    from megatron_bridge.runtime.batch import packed_places

    original = rope_utils._apply_rotary_pos_emb_thd

    @functools.wraps(original)
    def apply_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        tokens = context_parallel.held(t.shape[0] * parallel_state.get_context_parallel_world_size(), cu_seqlens,
                                       device=t.device)
        _, positions = packed_places(cu_seqlens, tokens)
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[positions], rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = apply_thd


def _cover_unfused_permute() -> None:
    """megatron-core 0.12.1's token permutation without TE's fused kernels finds each expert's tokens
    with ``masked_select``, whose output size the host must read from the device before it can go
    on: two host synchronisations per MoE layer and pass (the token and the probability order).
    Where the dispatcher already knows on the host how many tokens are routed (dropless alltoall: the
    tokens times top-k; allgather: a host count), the same order comes from a stable sort of the
    routing map, experts in order and each expert's tokens ascending, cut at that count: nothing
    waits. Every other path (TE's fused kernels, drop-and-pad, a count still on the device, another
    library's replacement of the function) runs as it was."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = token_dispatcher.permute
    if original is not moe_utils.permute:
        return  # replaced already by another library: left to it

    @functools.wraps(original)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        routed = _host_count(num_out_tokens)
        if fused or drop_and_pad or routed is None:
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad)
        sorted_indices, flat = routed_order(routing_map, routed)
        permuted_probs = None if probs is None else probs.reshape(-1).index_select(0, flat)
        return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices

    token_dispatcher.permute = permute


def _host_count(count) -> int | None:
    """A token count the host holds (a Python int, or a one-element tensor in host memory); None
    for one on the device or none at all."""
    if isinstance(count, int):
        return count
    if isinstance(count, torch.Tensor) and count.device.type == "cpu" and count.numel() == 1:
        return int(count)
    return None


def routed_order(routing_map: torch.Tensor, routed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed (token, expert) pairs of a [tokens, experts] boolean map in expert-major order, as
    ``masked_select`` over the transposed map gives them, without reading anything back: the token
    of each pair, and its position in the map flattened row-major (for the probabilities).
    ``routed`` must be the map's number of True entries."""
    tokens, experts = routing_map.shape
    expert_major = routing_map.T.reshape(-1).to(torch.int8)
    picked = expert_major.argsort(descending=True, stable=True)[:routed]  # True first, each in map order
    token = picked % tokens
    return token, token * experts + picked // tokens


def install(platform_name: str) -> None:
    """Install the covers for this process (idempotent); after the platform's own adaptor."""
    global _installed
    if _installed:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    _cover_fp8_quantize()
    _cover_torch_writer()
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    keep_mcore_data(_FileSystemWriter)
    _cover_adam_state(DistributedOptimizer)
    _cover_packed_rope()
    if platform_name != "npu":  # the NPU permutes with MindSpeed's kernels, or megatron's own where they are off
        _cover_unfused_permute()
    _installed = True
