"""Platform choice: explicit, never a silent CPU fallback; the CPU adaptor covers what megatron needs."""

import subprocess
import sys
import textwrap

import pytest
import torch


def _run(code: str, env_platform: str | None = None):
    import os

    env = dict(os.environ)
    env.pop("MOE_RL_PLATFORM", None)
    if env_platform:
        env["MOE_RL_PLATFORM"] = env_platform
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_requested_cuda_without_a_gpu_is_an_error_not_a_cpu_run():
    out = _run("from megatron_bridge.runtime import platform; platform.activate('cuda')")
    assert out.returncode != 0 and "platform cuda was requested but torch.cuda.is_available() is False" in out.stderr
    out = _run("from megatron_bridge.runtime import platform; platform.activate()", env_platform="cuda")
    assert out.returncode != 0 and "platform cuda was requested" in out.stderr


def test_requested_npu_without_torch_npu_is_an_error():
    out = _run("from megatron_bridge.runtime import platform; platform.activate('npu')")
    assert out.returncode != 0 and "platform npu" in out.stderr


def test_unknown_platform_lists_the_choices():
    out = _run("from megatron_bridge.runtime import platform; platform.activate('tpu')")
    assert "platform 'tpu' is unknown; choose one of: npu, cuda, cpu" in out.stderr


def test_cpu_adaptor_covers_megatron_cuda_assumptions():
    out = _run("""
        import torch
        from megatron_bridge.runtime import platform
        p = platform.activate()          # detected: no accelerator here
        assert p.name == 'cpu' and p.backend == 'gloo', p
        assert torch.zeros(2, device='cuda').device.type == 'cpu'
        assert torch.ones(2).cuda().device.type == 'cpu'
        assert torch.ones(2, dtype=torch.bfloat16).type() == 'torch.cuda.BFloat16Tensor'
        assert torch.ones(2).type(torch.float64).dtype == torch.float64
        torch.cuda.Stream().wait_stream(torch.cuda.current_stream())
        from megatron.core.tensor_parallel import random as r
        state = r._get_cuda_rng_state(clone=True); a = torch.rand(3); r._set_cuda_rng_state(state)
        assert torch.equal(a, torch.rand(3))
        from megatron.core.optimizer import distrib_optimizer
        assert distrib_optimizer.quantize_param_shard([], [], [], None) is None
        print('ok')
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


@pytest.mark.npu
def test_npu_platform_activates_mindspeed_before_megatron():
    out = _run("""
        from megatron_bridge.runtime import platform
        p = platform.activate('npu')
        import sys
        assert 'mindspeed.megatron_adaptor' in sys.modules and p.backend == 'hccl'
        print('ok')
    """)
    assert out.returncode == 0, out.stderr


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range():
    """Ports the kernel gives outgoing connections are never handed to a rendezvous, where a busy
    node's next connection could take one before the store binds it."""
    import socket

    from megatron_bridge.runtime.platform import _RENDEZVOUS_PORTS_FROM, _ephemeral_ports_from, free_port

    ports = {free_port() for _ in range(20)}
    assert len(ports) > 10  # drawn, not the same one each time
    for port in ports:
        assert _RENDEZVOUS_PORTS_FROM <= port < _ephemeral_ports_from()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
