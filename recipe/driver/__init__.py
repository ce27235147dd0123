"""The driver: the single controller that runs the RL loop (``trainer``) and its helpers: how a
step gets its samples and the engines its weights, on-policy or not (``generation``), the
asynchronous modes' schedule (``async_schedule``), the calls to the workers (``dispatch``), one
generation's samples (``rollouts``: ``Rollout``), the step's samples with DAPO's dynamic sampling (``dynamic_sampling``), GRPO advantages and KL in the
reward (``advantage``), the step's routing metrics (``routing``), checkpoints, resume and
provenance (``checkpoint``), and SIGTERM and SIGINT as a clean stop (``signals``)."""
