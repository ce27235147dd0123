"""The environment and the ``vllm.LLM`` arguments of the vLLM / vLLM-Ascend rollout engine.

``recipe.rollout.vllm_engine.VLLMEngine`` builds on these: whether vllm (and vllm-ascend) is
installed (``require_vllm``), vLLM's rules for the rollout layout (``check_rollout_parallel``), the
keyword arguments of ``vllm.LLM`` (``engine_args``), what the model directory provides (tokenizer,
EOS ids), and the environment variables set and checked before vllm is imported (``rollout_env``,
``apply_env``, ``check_env``, ``check_launcher_env``). Nothing here imports vllm, so it is tested
without it.

API facts relied on (vllm-project/vllm, vllm-project/vllm-ascend; versions as noted):

- ``LLM(..., distributed_executor_backend="external_launcher")``: one worker per process, ranks from
  ``RANK`` / ``LOCAL_RANK`` and ``env://``; ParallelConfig then sets VLLM_ENABLE_V1_MULTIPROCESSING=0
  so the engine core runs in-process (vllm/config/parallel.py; examples/offline_inference/
  torchrun_example.py). ``data_parallel_size`` with external_launcher: PR #24899 (Sept 2025, before
  0.11.0).
- ``logprobs_mode``: "raw_logprobs" (default: before temperature and any processing) or
  "processed_logprobs" (after temperature, penalties and top-k/top-p), vLLM PR #21398 and #22387,
  vllm/v1/sample/sampler.py (0.10.2+). With all-greedy batches the processed log-probs are
  log_softmax(logits) (no temperature).
- vllm-ascend's NPUWorker.wake_up refuses VLLM_ASCEND_ENABLE_NZ=1 ("FRACTAL_NZ mode is enabled ...
  Please set VLLM_ASCEND_ENABLE_NZ=0", vllm_ascend/worker/worker_v1.py, 0.11 era).
- Sleep mode's memory pool does not work with ``expandable_segments:True`` (vLLM 0.11's
  CuMemAllocator asserts; vllm-ascend sleep then frees nothing, ms-swift #6636).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from megatron_bridge.errors import ConfigError
from megatron_bridge.plan.layout import RolloutParallel
from recipe.rollout import ENGINES

PLATFORMS = ("cuda", "npu")
VLLM_VERSION, VLLM_ASCEND_VERSION = "0.11.0", "0.11.0rc1"
INSTALL = {
    "cuda": f"pip install -e '.[gpu]' (the gpu extra installs vllm; written against vllm=={VLLM_VERSION})",
    "npu": (
        f"pip install vllm=={VLLM_VERSION} vllm-ascend=={VLLM_ASCEND_VERSION} (the pair in vllm-ascend's "
        "version table; follow its installation guide for the CANN and torch_npu it needs)"
    ),
}
LOGPROBS_MODE = "processed_logprobs"  # see the module doc and docs/rollout.md


class VLLMNotInstalledError(ImportError):
    """vllm (or vllm-ascend on NPU) is not installed; the message says what to install."""


# -- configuration (pure) -----------------------------------------------------------------------


def check_rollout_parallel(rollout: RolloutParallel, world_size: int | None = None) -> None:
    """vLLM's rules for a rollout layout; raises ConfigError naming the YAML keys."""
    keys = "actor_rollout_ref.rollout"
    for key, value in (("tensor_model_parallel_size", rollout.tp), ("data_parallel_size", rollout.dp),
                       ("expert_parallel_size", rollout.ep), ("max_num_seqs", rollout.max_num_seqs)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{keys}.{key}={value!r} must be a positive integer")
    if not 0 < rollout.gpu_memory_utilization < 1:
        raise ConfigError(f"{keys}.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1)")
    tp_dp = rollout.tp * rollout.dp
    if rollout.ep not in (1, tp_dp):
        raise ConfigError(
            f"{keys}.expert_parallel_size={rollout.ep}: vLLM runs MoE layers either with expert parallel, "
            f"where EP = {keys}.tensor_model_parallel_size x {keys}.data_parallel_size = {rollout.tp} x "
            f"{rollout.dp} = {tp_dp}, or without it (expert_parallel_size=1: experts tensor-sharded over "
            f"TP x DP); set expert_parallel_size to {tp_dp} or 1"
        )
    if world_size is not None and tp_dp != world_size:
        raise ConfigError(
            f"{keys}.tensor_model_parallel_size x {keys}.data_parallel_size = {rollout.tp} x {rollout.dp} = "
            f"{tp_dp} must equal the rollout ranks' world size {world_size} (each is one vLLM rank: the training "
            "ranks colocated, the rollout pool's ranks with actor_rollout_ref.hybrid_engine=false)"
        )


def engine_args(
    model_path: str,
    rollout: RolloutParallel,
    *,
    dtype: str | torch.dtype = "bfloat16",
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    max_num_seqs: int | None = None,
    seed: int = 0,
    enable_sleep_mode: bool = True,
    enforce_eager: bool = False,
    load_format: str = "dummy",
    skip_tokenizer_init: bool = True,
    return_routed_experts: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for one colocated rank (vLLM 0.11 names).

    ``extra`` is merged last (its None values dropped), as verl's ``engine_kwargs.vllm``.
    """
    check_rollout_parallel(rollout)
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        # SPMD: this process is one vLLM rank; torch.distributed is the trainer's.
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": rollout.tp,
        "data_parallel_size": rollout.dp,
        # EP on: each of the TP x DP ranks owns whole experts; off: experts tensor-sharded over TP x DP.
        "enable_expert_parallel": rollout.ep > 1,
        "dtype": dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
        "gpu_memory_utilization": rollout.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization,
        "max_num_seqs": rollout.max_num_seqs if max_num_seqs is None else max_num_seqs,
        # one seed on every rank, as vLLM's torchrun examples ask (the engine draws its samples
        # from its own per-DP-rank stream, see VLLMEngine)
        "seed": seed,
        "enable_sleep_mode": enable_sleep_mode,
        "enforce_eager": enforce_eager,
        # random weights at start; the first load_weights brings the trainer's
        "load_format": load_format,
        # log-probs after temperature (and top-k/top-p): see docs/rollout.md
        "logprobs_mode": LOGPROBS_MODE,
        # prompts and responses are token ids; a model dir without a tokenizer needs True
        # (VLLMEngine passes True only then: vLLM 0.10.0 broke it, vllm issue #21846)
        "skip_tokenizer_init": skip_tokenizer_init,
        # NCCL / HCCL all-reduce only, as verl's colocated rollout sets it
        "disable_custom_all_reduce": True,
        "disable_log_stats": True,
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if return_routed_experts:  # see routed_experts_problem
        kwargs["enable_return_routed_experts"] = True
    kwargs.update({k: v for k, v in (extra or {}).items() if v is not None})
    return kwargs


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_path: str) -> bool:
    """Whether the model directory has tokenizer files vLLM could load."""
    return any(os.path.isfile(os.path.join(model_path, f)) for f in _TOKENIZER_FILES)


def model_eos_token_ids(model_path: str) -> set[int]:
    """EOS ids of config.json and generation_config.json (Qwen3 lists a second one only there)."""
    ids: set[int] = set()
    for file in ("config.json", "generation_config.json"):
        path = os.path.join(model_path, file)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
    return ids


# -- environment (pure) -------------------------------------------------------------------------


def rollout_env(platform: str) -> dict[str, str]:
    """Environment variables the vLLM rollout needs, set before vllm is imported."""
    env = {
        # external_launcher needs the engine core in this process (ParallelConfig sets it too)
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    if platform == "npu":
        env.update({
            # the V1 engine (vllm-ascend 0.11 has no other)
            "VLLM_USE_V1": "1",
            # weights in ND format: the trainer's tensors are written in place, and vllm-ascend's
            # wake_up refuses NZ; verl forces 0 (VLLM_ENABLE_MC2 is deliberately absent: vllm-ascend
            # removed it in June 2025, PR #1229, and picks MC2 itself)
            "VLLM_ASCEND_ENABLE_NZ": "0",
            # HCCL picks free ports itself, so the trainer's and vLLM's communicators on one NPU do
            # not collide (verl's runtime_env.yaml)
            "HCCL_HOST_SOCKET_PORT_RANGE": "auto",
            "HCCL_NPU_SOCKET_PORT_RANGE": "auto",
        })
    return env


def ascend_env() -> dict[str, str]:
    """``rollout_env("npu")``: what rollout on Ascend needs (see the comments there)."""
    return rollout_env("npu")


@dataclass
class EnvReport:
    set: dict[str, str] = field(default_factory=dict)  # variables this call set
    kept: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (user's value, ours)


def apply_env(wanted: Mapping[str, str], environ: Any = None) -> EnvReport:
    """Set ``wanted`` in ``environ`` (os.environ by default) except where the user set a value."""
    environ = os.environ if environ is None else environ
    report = EnvReport()
    for name, value in wanted.items():
        if name not in environ:
            environ[name] = value
            report.set[name] = value
        elif environ[name] != value:
            report.kept[name] = (environ[name], value)
    return report


@dataclass
class EnvCheck:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def check_env(platform: str, environ: Mapping[str, str], enable_sleep_mode: bool = True) -> EnvCheck:
    """Settings that break the vLLM rollout (errors) or do nothing (warnings)."""
    out = EnvCheck()
    alloc = "PYTORCH_NPU_ALLOC_CONF" if platform == "npu" else "PYTORCH_CUDA_ALLOC_CONF"
    conf = environ.get(alloc, "").replace(" ", "")
    if enable_sleep_mode and "expandable_segments:True" in conf:
        out.errors.append(
            f"{alloc}={environ[alloc]!r}: vLLM's sleep mode allocates from a memory pool that does not work with "
            "expandable_segments:True (CUDA: vLLM asserts; NPU: sleep frees nothing); remove it or set "
            "expandable_segments:False"
        )
    if platform == "npu":
        if environ.get("VLLM_ASCEND_ENABLE_NZ", "0") not in ("0", ""):
            out.errors.append(
                f"VLLM_ASCEND_ENABLE_NZ={environ['VLLM_ASCEND_ENABLE_NZ']!r}: weight sync needs the ND format "
                "(vllm-ascend's wake_up refuses NZ); unset it or set 0"
            )
        if "VLLM_ENABLE_MC2" in environ:
            out.warnings.append(
                "VLLM_ENABLE_MC2 is set but vllm-ascend removed it in June 2025 (PR #1229); MC2 is chosen "
                "automatically, the variable does nothing"
            )
    return out


def check_launcher_env(environ: Mapping[str, str]) -> None:
    """external_launcher reads the rank from RANK and the device from LOCAL_RANK (torchrun sets both)."""
    missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: vLLM's external_launcher mode reads them as torchrun sets them"
        )


def routed_experts_problem(engine_args_class: Any, version: str) -> str | None:
    """Why this vLLM cannot report each token's experts, or None when it can. The engine argument
    ``enable_return_routed_experts`` (``CompletionOutput.routed_experts``, [tokens, layers, k] from
    the first prompt token) first shipped in vLLM 0.14 (PR #28284); the pinned vLLM 0.11 and
    vLLM-Ascend 0.11.0rc1 lack it."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(engine_args_class)} if dataclasses.is_dataclass(engine_args_class) else set()
    if "enable_return_routed_experts" in names:
        return None
    return (f"vLLM {version} cannot report the experts it routes each token to (its EngineArgs has no "
            "enable_return_routed_experts, which vLLM added in 0.14); routing replay R3 and the "
            "moe/rollout_routing_mismatch metrics need it: set actor_rollout_ref.rollout.enable_rollout_routing_replay=false "
            "(and router_replay.mode=R2 or disabled), or install a vLLM / vLLM-Ascend pair that has it")


def require_vllm(platform: str) -> None:
    """Raise VLLMNotInstalledError naming the install command if vllm (or vllm-ascend) is missing.
    Looks the packages up without importing them (env variables must be set first)."""
    if platform not in PLATFORMS:
        raise ValueError(
            f"VLLMEngine runs on {' or '.join(PLATFORMS)}, not {platform!r}; on the CPU use "
            "recipe.rollout.hf_engine.HFEngine"
        )
    missing = ENGINES["vllm"].missing(platform)
    if missing:
        names = " and ".join(m.replace("_", "-") for m in missing)
        raise VLLMNotInstalledError(f"VLLMEngine on {platform} needs {names}, which is not installed: {INSTALL[platform]}")
