"""The RL loop (config, data, rollout, rewards, advantages, trainer): arrives with the recipe issue."""
