"""The Megatron-Core side of the package, one room per concern:

- ``plan``: layouts, model shapes, validation, memory and MC2 planning, the ``plan`` command; runs
  before any process starts and never imports megatron;
- ``runtime``: platform adaptors (npu / cuda / cpu), the Qwen3-MoE model build and the Megatron
  actor of one rank;
- ``weights``: HF checkpoints read into TP/PP/EP shards and the shards streamed back out with Hub
  names for the rollout engine;
- ``moe``: expert routing: capture, replay and the drift between two routings;
- ``verify`` (command) and ``tiny_model``: checks and the tiny model that span the rooms.

Importing this package does not import megatron (the platform must be chosen first).
"""
