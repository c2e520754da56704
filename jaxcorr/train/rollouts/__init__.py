"""Where the trainer's batches come from: the `RolloutSource` producers.

Modules: `config` (the `rollout` section), `source` (the interface and the
sync producer), `fixed_lag` (async with a fixed policy lag), `stream`
(continuous decoding with in-flight weight swaps), `stage` (prompts -> scored
rollouts, shared by all three), `staleness` (per-token staleness policies),
`weights` (the weight copies published to the engine).
"""
