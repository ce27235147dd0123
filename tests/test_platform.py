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
        # megatron's fused kernels compile at their first call: nothing imported inductor yet
        import sys
        from megatron.core.jit import jit_fuser
        from megatron.core.fusions.fused_bias_gelu import bias_gelu
        assert jit_fuser is not torch.compile and bias_gelu.__name__ == 'bias_gelu', jit_fuser
        assert not any(m.startswith('torch._inductor') for m in sys.modules)
        print('ok')
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_a_deferred_compile_compiles_once_at_the_first_call_with_its_options():
    from megatron_bridge.runtime.cpu_adaptor import compile_at_first_call

    compiled = []

    def compile_now(model, **options):  # records the compile; "compiles" to the function itself
        compiled.append(options)
        return model

    compile_ = compile_at_first_call(compile_now)
    double = compile_(lambda x: 2 * x, backend="eager")

    @compile_(dynamic=False)
    def square(x):
        return x * x

    assert compiled == []
    assert double(torch.tensor(3.0)) == 6 and double(torch.tensor(4.0)) == 8
    assert square(torch.tensor(3.0)) == 9 and square.__name__ == "square"
    assert compiled == [{"backend": "eager"}, {"dynamic": False}]
    assert float(compile_at_first_call(torch.compile)(lambda x: x + 1, backend="eager")(torch.tensor(1.0))) == 2


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
