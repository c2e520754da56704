"""Multi-turn tool-use RL (docs/agents.md): environments an agent acts in,
tools described by JSON schemas, token-in / token-out trajectories and the
multi-turn rollout driver that keeps each trajectory's KV cache across turns.

* `tools`: `Tool` (a function and its OpenAI-style JSON schema);
* `calculator`: a safe arithmetic evaluator (no `eval`) and its tool;
* `tool_calls`: the documented tool-call format and its parser;
* `tool_runner`: tools run with a timeout, failures contained and counted;
* `environment`: the `Environment` API, `ToolEnvironment`, the registry;
* `turns`: the chat template's token delta of each new message;
* `trajectory`: one trajectory as one sequence with an agent mask, and the
  `RolloutBatch` of a batch of them;
* `continuation`: prefilling environment tokens onto a live decode slot;
* `driver`: continuous batching over trajectories at different turns;
* `config`: `AgentConfig`, the trainer's `agent` section.
"""
