"""The shape of a Qwen3-MoE model, read from a HF ``config.json`` or a YAML in ``configs/model/``.

Model YAMLs use the HF config keys, so one reader serves both and a YAML can be turned into a
``transformers`` config as it is. Keys renamed by transformers 5 (``num_local_experts``,
``rope_parameters``) are read too.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import yaml

from megatron_bridge.errors import ConfigError
from megatron_bridge.configs import YamlLoader, find_config, shipped

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    num_experts: int
    moe_topk: int
    moe_ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    norm_topk_prob: bool
    tie_word_embeddings: bool
    router_aux_loss_coef: float

    # Parameter counts: the memory model and the shard planner both count from these.
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        qkv = (self.q_dim + 2 * self.kv_dim) * self.hidden_size
        proj = self.hidden_size * self.q_dim
        return qkv + proj + 2 * self.head_dim  # + q_norm, k_norm

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def non_expert_params_per_layer(self) -> int:
        router = self.num_experts * self.hidden_size
        return self.attention_params_per_layer + router + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        per_layer = self.non_expert_params_per_layer + self.num_experts * self.expert_params
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * per_layer + self.embedding_params + head + self.hidden_size

    @property
    def active_params(self) -> int:
        per_layer = self.non_expert_params_per_layer + self.moe_topk * self.expert_params
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * per_layer + self.embedding_params + head + self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first(cfg: Mapping[str, Any], *keys: str, default: Any = None, source: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    if default is not None:
        return default
    raise ConfigError(f"{source}: missing key {keys[0]!r} (a Qwen3-MoE config.json has it)")


def spec_from_hf_dict(cfg: Mapping[str, Any], name: str, source: str) -> ModelSpec:
    """Build a ModelSpec from HF config keys (transformers 4 or 5 spelling)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(
            f"{source}: dense layers (mlp_only_layers / decoder_sparse_step != 1) are not supported; "
            "every Qwen3-MoE release uses MoE in all layers"
        )
    rope = cfg.get("rope_parameters") or {}
    hidden = int(_first(cfg, "hidden_size", source=source))
    heads = int(_first(cfg, "num_attention_heads", source=source))
    return ModelSpec(
        name=name,
        hidden_size=hidden,
        num_layers=int(_first(cfg, "num_hidden_layers", source=source)),
        num_attention_heads=heads,
        num_query_groups=int(_first(cfg, "num_key_value_heads", source=source)),
        head_dim=int(_first(cfg, "head_dim", default=hidden // heads, source=source)),
        num_experts=int(_first(cfg, "num_experts", "num_local_experts", source=source)),
        moe_topk=int(_first(cfg, "num_experts_per_tok", source=source)),
        moe_ffn_hidden_size=int(_first(cfg, "moe_intermediate_size", source=source)),
        vocab_size=int(_first(cfg, "vocab_size", source=source)),
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", source=source)),
        # transformers 5 moves rope_theta into rope_parameters; 4.x default would be 10000.
        rope_theta=float(rope.get("rope_theta") or _first(cfg, "rope_theta", source=source)),
        rms_norm_eps=float(_first(cfg, "rms_norm_eps", source=source)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
    )


def load_hf_config(path: str) -> dict[str, Any]:
    """The raw HF-style config dict from a model directory, a config.json, a model YAML or a
    shipped model name (``qwen3_30b_a3b``)."""
    candidate = os.path.join(path, "config.json") if os.path.isdir(path) else find_config("model", path)
    if candidate is not None and os.path.isfile(candidate):
        with open(candidate) as f:
            try:
                data = json.load(f) if candidate.endswith(".json") else yaml.load(f, Loader=YamlLoader)
            except (json.JSONDecodeError, yaml.YAMLError) as e:
                raise ConfigError(f"{candidate}: not valid {'JSON' if candidate.endswith('.json') else 'YAML'}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{candidate}: expected a mapping of config keys")
        return data
    raise ConfigError(
        f"model {path!r}: no such directory with config.json, file, or shipped model; "
        f"shipped models: {', '.join(shipped('model'))}"
    )


def load_model_spec(path: str) -> ModelSpec:
    name = os.path.basename(os.path.normpath(path))
    for suffix in (".yaml", ".json"):
        name = name.removesuffix(suffix)
    if name == "config":
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return spec_from_hf_dict(load_hf_config(path), name=name, source=path)
