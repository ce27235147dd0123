"""Planning a layout before a single process starts: model shapes (``model_spec``), layouts
(``layout``), pipeline stages, the validator, memory and MC2 estimates and the ``plan`` command
(``cli``). Nothing here imports megatron."""
