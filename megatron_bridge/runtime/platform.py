"""Pick the platform before megatron is imported: ``npu`` (torch_npu + MindSpeed, hccl),
``cuda`` (nccl) or ``cpu`` (gloo, tests and the tiny default only); what each one is
(``megatron_bridge.plan.platforms``) the planner reads too.

An explicitly requested accelerator that is not there is an error, never a silent CPU run.
The choice comes from the argument, else ``$MOE_RL_PLATFORM``, else detection.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import socket
import sys

import torch

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.platforms import PLATFORMS, Platform

PLATFORM_ENV = "MOE_RL_PLATFORM"

_active: Platform | None = None


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def detect() -> str:
    if _npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _activate_npu() -> None:
    if "megatron.core" in sys.modules:
        raise ConfigError(
            "platform npu: megatron was imported before MindSpeed's adaptor; call "
            "megatron_bridge.runtime.platform.activate('npu') before importing megatron"
        )
    for module in ("torch_npu", "torch_npu.contrib.transfer_to_npu"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"platform npu: cannot import {module} ({e}); install torch_npu and MindSpeed "
                "(see README, 'Install on Ascend')"
            ) from e
    from megatron_bridge.runtime import mindspeed

    # MindSpeed parses sys.argv into its features at import: import it without this process's command line
    mindspeed.import_adaptor()
    if not torch.npu.is_available():
        raise ConfigError("platform npu was requested but torch.npu.is_available() is False")


def activate(name: str | None = None) -> Platform:
    """Activate a platform for this process; the same one may be activated again."""
    global _active
    name = name or os.environ.get(PLATFORM_ENV) or detect()
    if name not in PLATFORMS:
        raise ConfigError(f"platform {name!r} is unknown; choose one of: {', '.join(PLATFORMS)}")
    if _active is not None:
        if _active.name != name:
            raise ConfigError(f"platform {_active.name} is already active; cannot switch to {name}")
        return _active
    if name == "npu":
        _activate_npu()
    elif name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("platform cuda was requested but torch.cuda.is_available() is False")
    else:
        from megatron_bridge.runtime import cpu_adaptor

        cpu_adaptor.install()
    from megatron_bridge.runtime import megatron_compat

    megatron_compat.install(name)
    _active = PLATFORMS[name]
    return _active


def active() -> Platform:
    if _active is None:
        raise RuntimeError("no platform is active; call megatron_bridge.runtime.platform.activate() first")
    return _active


# Ray's workers listen on 10002-19999 (its default min/max_worker_port).
_RENDEZVOUS_PORTS_FROM = 20000


def _ephemeral_ports_from() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a rendezvous that another process binds moments later.
    Drawn below the kernel's ephemeral range: a port the kernel hands out (bind to port 0) is also
    what it gives the next outgoing connection, and on a busy node (Ray, other runs) one of those
    takes it before the store binds it."""
    draw = random.SystemRandom()
    top = _ephemeral_ports_from()
    for _ in range(64 if top > _RENDEZVOUS_PORTS_FROM else 0):
        port = draw.randrange(_RENDEZVOUS_PORTS_FROM, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(platform: Platform) -> torch.device:
    """Join the torch.distributed job started by torchrun (or Ray) on ``platform``'s backend and
    return this rank's device. Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT."""
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set: start this under torchrun (e.g. torchrun --nproc-per-node N ...)")
    if platform.name == "cpu":
        device = torch.device("cpu")
    else:
        # transfer_to_npu routes torch.cuda.* to the NPU, so one call serves both accelerators.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device(platform.name, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(platform.backend)
    return device


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without making the host wait. A plain copy from host memory up to a
    CUDA device waits for everything queued on the device before it; from pinned memory the copy
    is queued like a kernel (torch keeps the pinned buffer until it is done)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
