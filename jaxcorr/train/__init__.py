"""The RL trainer: data, rewards, jitted steps, host loop, checkpoints."""
