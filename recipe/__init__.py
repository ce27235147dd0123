"""The RL loop, one room per concern:

- ``config``: the one typed, checked recipe config, verl's key spellings included (``config.verl``);
- ``data``: prompt files and the built-in tiny tasks;
- ``reward``: rule rewards and user reward functions;
- ``rollout``: the rollout engines behind one interface, their registry, the weight sync;
- ``workers``: one Ray actor per device, with an actor role, a rollout role or both;
- ``driver``: the trainer (one RL step, read top to bottom) and its helpers;
- ``run_dir``: a run's directory on disk (its files, the checkpoints' layout, what a run resumes from);
- ``tracking``: metrics and loggers;
- ``compare``: runs of GRPO / GSPO variants and their stability report;
- entry points: ``main`` (``main_gspo``, ``main_grpo``), ``compare``, ``evaluate`` (a model,
  checkpoint or run scored on prompt files), ``model_merger`` (a checkpoint exported as a HF
  model), ``cluster`` (the launchers' helper).
"""
