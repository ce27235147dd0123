"""Planning a layout before a single process starts: model shapes (``model_spec``), layouts
(``layout``), what each platform is (``platforms``), pipeline stages (``stages``), the validator
(``validate``), memory estimates (``memory``) and the rollout's MC2 facts (``mc2``), the predicted
step time (``step_time``, from ``flops``, ``collectives`` and the rates of ``hardware``), a layout's
verdict (``verdict``), the search for layouts (``search``) and the ``plan`` command (``cli``,
``__main__``). Nothing here imports megatron."""
