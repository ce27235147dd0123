"""What megatron-core 0.12.1 needs to run on CPU gloo ranks, and nothing more.

megatron-core assumes CUDA in a handful of places (measured one by one, see
shared/reference/cpu_platform_findings.md). Each block below covers exactly one of them. The
adaptor is installed only when the ``cpu`` platform is chosen explicitly or detected on a machine
with no accelerator: it is for tests and the tiny default, never a fallback for a requested
accelerator.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_installed = False

# Tensor.type() names megatron's optimizer compares against (distrib_optimizer, clip_grads).
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True  # megatron passes torch.cuda.current_device() ints as devices
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites a CUDA ``device`` argument to CPU for every torch call (megatron hard-codes
    ``device="cuda"`` in the causal mask and the schedules' token counter), turns
    ``Tensor.cuda()`` into a no-op and makes ``Tensor.type()`` report the CUDA type name the
    optimizer checks for. One mode covers all call sites instead of patching each."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """Stand-in for torch.cuda.Stream/Event: CPU ops are synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _cover_cuda_runtime() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.Stream = _NoStream
    cuda.Event = _NoStream
    cuda.current_stream = lambda *a, **k: _NoStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    # The RNG tracker saves and restores "the CUDA generator": on CPU that is the CPU generator.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.nn.Module.cuda = lambda self, *a, **k: self


def _cover_megatron() -> None:
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils

    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mp_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    # Referenced by the router without Transformer Engine; unused unless TE's fused GEMM is on.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # Called on every optimizer step; without TE it raises even when there is no FP8 parameter.
    original = distrib_optimizer.quantize_param_shard

    @functools.wraps(original)
    def quantize_param_shard(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    distrib_optimizer.quantize_param_shard = quantize_param_shard
    _cover_dist_checkpointing(distrib_optimizer.DistributedOptimizer)


def _cover_dist_checkpointing(optimizer_class) -> None:
    """The checkpoint path (``megatron_bridge.runtime.checkpoint``): megatron's torch_dist writer
    and the DistributedOptimizer's state dict without Apex or Transformer Engine, which are not
    installed on the CPU path (torch's Adam keeps a ``step`` tensor in each parameter's state)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item

    # torch >= 2.8 added a required `serialization_format` to this private function; 0.12.1
    # calls it with the five arguments of torch 2.7.
    def write_item(*args):
        return _write_item(*args, SerializationFormat.TORCH_SAVE) if len(args) == 5 else _write_item(*args)

    filesystem_async._write_item = write_item

    # `state_dict()` reads Adam's `step` from the state, which does not exist before the first
    # step: a checkpoint is loaded into a fresh optimizer. Allocate it (zeros, step 0) first.
    sharded_state_dict = optimizer_class.sharded_state_dict

    @functools.wraps(sharded_state_dict)
    def allocated_sharded_state_dict(self, *args, **kwargs):
        if not self.optimizer.state:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
        return sharded_state_dict(self, *args, **kwargs)

    optimizer_class.sharded_state_dict = allocated_sharded_state_dict

    # Loading copies every state tensor from the checkpoint's, but `step` is restored from the
    # param groups (load_state_dict) and not among them: leave it out of the copy.
    set_states = optimizer_class._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_but_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        set_states(self, model_param, tensors)
        if step is not None:
            state["step"] = step

    optimizer_class._set_main_param_and_optimizer_states = set_states_but_step

    # ... and restores it as one tensor shared by every parameter's state, which torch's Adam then
    # increments in place once per parameter: give each state its own.
    load_state_dict = optimizer_class.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    optimizer_class.load_state_dict = load_state_dict_own_steps


def install() -> None:
    """Install the CPU adaptor for this process (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU adaptor must not be installed on a machine with CUDA devices")
    _cover_cuda_runtime()
    _cover_megatron()
    # Entered for the life of the process: megatron's calls can come from any module.
    _CudaToCpuMode().__enter__()
    _installed = True
