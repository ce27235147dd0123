"""Read slices of a Hugging Face safetensors checkpoint without loading whole tensors.

A rank asks for exactly the rows or columns it owns; safetensors reads them from the memory-mapped
file, so no rank ever holds the whole model. Checkpoints saved by transformers 5 with
``save_original_format=False`` keep experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``); the per-expert Hub names are served from those too.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack

import torch
from safetensors import safe_open

from megatron_bridge.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ConfigError):
    """A checkpoint is missing a tensor, has a wrong shape, or cannot be read."""


class HFCheckpoint:
    """The tensors of a HF model directory (``model.safetensors`` or sharded with an index).

    ``read(name, rows, cols)`` returns one slice; ``bytes_read`` counts what was read, so tests and
    logs can show that a rank read only its shard.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._files = ExitStack()
        self._handles: dict[str, object] = {}
        self.weight_map = self._weight_map()
        self.bytes_read = 0

    def _weight_map(self) -> dict[str, str]:
        if not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint {self.directory!r}: no such directory")
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                try:
                    return dict(json.load(f)["weight_map"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(
                f"checkpoint {self.directory!r}: no *.safetensors files (save the model with "
                "transformers' save_pretrained, which writes safetensors)"
            )
        weight_map = {}
        for file in files:
            for name in self._handle(file).keys():
                weight_map[name] = file
        return weight_map

    def _handle(self, file: str):
        if file not in self._handles:
            path = os.path.join(self.directory, file)
            try:
                self._handles[file] = self._files.enter_context(safe_open(path, framework="pt"))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path}: cannot be read as safetensors ({e})") from e
        return self._handles[file]

    def close(self) -> None:
        self._files.close()
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _locate(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(stored tensor name, leading index into it) for ``name``."""
        if name in self.weight_map:
            return name, ()
        m = _PER_EXPERT.match(name)
        if m:
            fused = f"{m['prefix']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
            if fused in self.weight_map:
                return fused, (int(m["expert"]),)
        raise CheckpointError(f"checkpoint {self.directory!r} has no tensor {name!r}")

    def _slice(self, stored: str):
        return self._handle(self.weight_map[stored]).get_slice(stored)

    def _fused_half(self, name: str, stored: str) -> tuple[slice, ...]:
        # gate_up_proj[e] holds gate rows [0, I) then up rows [I, 2I).
        if not stored.endswith("gate_up_proj"):
            return ()
        half = self._slice(stored).get_shape()[1] // 2
        return (slice(0, half),) if name.endswith("gate_proj.weight") else (slice(half, 2 * half),)

    def shape(self, name: str) -> tuple[int, ...]:
        stored, lead = self._locate(name)
        shape = self._slice(stored).get_shape()[len(lead):]
        if self._fused_half(name, stored):
            shape[0] //= 2
        return tuple(shape)

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows and/or columns of tensor ``name`` (all of it when both are None)."""
        stored, lead = self._locate(name)
        half = self._fused_half(name, stored)
        if half and rows is not None:
            start, stop, _ = rows.indices(half[0].stop - half[0].start)
            rows = slice(half[0].start + start, half[0].start + stop)
        elif half:
            rows = half[0]
        index = (*lead, rows if rows is not None else slice(None))
        if cols is not None:
            index = (*index, cols)
        tensor = self._slice(stored)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor
