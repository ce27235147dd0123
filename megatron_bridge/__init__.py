"""The Megatron-Core side of the package, one room per concern:

- ``plan``: layouts, model shapes, validation, memory and MC2 planning, the ``plan`` command; runs
  before any process starts and never imports megatron;
- ``runtime``: platform adaptors (npu / cuda / cpu), the Qwen3-MoE model build and the Megatron
  actor of one rank;
- ``weights``: HF checkpoints read into TP/PP/EP shards and the shards streamed back out with Hub
  names for the rollout engine;
- ``moe``: expert routing: capture, replay and the drift between two routings;
- what spans the rooms: the ``verify`` command (a HF checkpoint in a layout against transformers),
  the tiny model (``tiny_model``), where the shipped YAMLs live (``configs``), the errors that
  name the input and the fix (``errors``) and files written whole (``atomic``).

Importing this package does not import megatron (the platform must be chosen first).
"""
