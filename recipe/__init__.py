"""The RL loop: config, data, rollout engines, rewards, advantages, Ray workers, the trainer,
metrics and loggers, checkpoints and the comparison report."""
