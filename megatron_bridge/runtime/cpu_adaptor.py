"""What megatron-core 0.12.1 needs to run on CPU gloo ranks, and nothing more.

megatron-core assumes CUDA in a handful of places (measured one by one, see
docs/sources.md). Each block below covers exactly one of them; what
megatron needs without Transformer Engine on any platform is ``megatron_compat``'s. The adaptor is
installed only when the ``cpu`` platform is chosen explicitly or detected on a machine with no
accelerator: it is for tests and the tiny default, never a fallback for a requested accelerator.
"""

from __future__ import annotations

import contextlib
import functools
import sys

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
    ``device="cuda"`` in the causal mask and the schedules' token counter), drops ``pin_memory``
    (context parallel's rotary embedding pins its chunk index; the CPU has no pinned memory), turns
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
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
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


def compile_at_first_call(compile_now):
    """``torch.compile`` (given as ``compile_now``) that compiles a function at its first call
    instead of when it is wrapped: the same function, compiled the same way if it ever runs."""

    def compile_(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return functools.partial(compile_, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_


def _import_megatron_with_deferred_compiles() -> None:
    """megatron-core wraps its fused kernels in ``torch.compile`` as its modules are imported, and
    that imports dynamo and inductor (about 0.9 s of CPU in every rank, at every start) although a
    CPU rank never calls those kernels: import megatron here first, with ``compile_at_first_call``."""
    if "megatron.core.jit" in sys.modules:
        return
    compile_now = torch.compile
    torch.compile = compile_at_first_call(compile_now)
    try:
        import megatron.core  # noqa: F401  (megatron.core.jit binds torch.compile as it is imported)
    finally:
        torch.compile = compile_now


def _cover_megatron() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mp_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )


def install() -> None:
    """Install the CPU adaptor for this process (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CPU adaptor must not be installed on a machine with CUDA devices")
    _cover_cuda_runtime()
    _import_megatron_with_deferred_compiles()
    _cover_megatron()
    # Entered for the life of the process: megatron's calls can come from any module.
    _CudaToCpuMode().__enter__()
    _installed = True
