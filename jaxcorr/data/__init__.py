"""Text <-> token ids for the trainer: every piece between a dataset row and
the ids the engine samples from.

Modules: `config` (the `data` section), `tasks` (the embedded arithmetic
task and its character tokenizer), `reasoning_gym` (reasoning-gym tasks
as a source), `prompts` (prompt sources and the checkpointable loader),
`chat` (a model's own chat template as the prompt template), `text` (prompts in, responses out), `prompt_check` (every prompt
tokenized and length-checked at start-up).
"""
