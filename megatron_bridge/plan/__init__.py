"""Planning a layout before a single process starts: model shapes (``model_spec``), layouts
(``layout``), what each platform is (``platforms``), pipeline stages, the validator, memory and MC2
estimates, a layout's verdict (``verdict``), the search for layouts (``search``) and the ``plan``
command (``cli``). Nothing here imports megatron."""
