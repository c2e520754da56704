"""Environments written for other RL stacks, run by the trainer: OpenEnv
servers (`openenv_env`) and verifiers environments (`verifiers_env`)
(docs/agents.md, "Environment hubs")."""
