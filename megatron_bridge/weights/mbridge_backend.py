"""mbridge (0.15.1) as an optional checkpoint loader, checked against ours.

mbridge cannot be imported without Transformer Engine, reads only TE parameter names
(``linear_qkv.layer_norm_weight``, ``linear_fc1.weight{e}``) and is being deprecated by its
maintainers, so the built-in loader is the default. Where mbridge imports (GPU with TE, or
MindSpeed's TE shims), ``load_with_mbridge`` loads through it and reports every parameter on which
it disagrees with the built-in mapping.
"""

from __future__ import annotations

import torch

from megatron_bridge.errors import ConfigError
from megatron_bridge.weights.load import read_shards, unwrap
from megatron_bridge.plan.model_spec import ModelSpec


def import_mbridge():
    try:
        import mbridge
    except Exception as e:  # ImportError, or TE's own errors when TE is half-installed
        raise ConfigError(
            f"mbridge cannot be imported here ({type(e).__name__}: {e}); it needs Transformer Engine and a "
            "model built with TE's layer names. Use the built-in loader (the default)."
        ) from e
    return mbridge


def load_with_mbridge(chunks: list[torch.nn.Module], spec: ModelSpec, directory: str) -> list[str]:
    """Load ``directory`` into ``chunks`` with mbridge; the names of the parameters whose values
    differ from what the built-in loader reads (empty when the two agree exactly)."""
    mbridge = import_mbridge()
    bridge = mbridge.AutoBridge.from_pretrained(directory)
    bridge.load_weights([unwrap(c) for c in chunks], directory)
    ours, _ = read_shards(chunks, spec, directory)
    return [
        name for param, name, shard in ours
        if not torch.equal(param.detach().cpu(), shard.to(param.dtype))
    ]
