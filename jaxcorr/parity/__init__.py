"""`python -m jaxcorr.parity`: engine vs trainer log-prob parity, per setting.

For a model and a batch of prompts, the real rollout (`PolicyEngine`, μ)
and the trainer's π_old on the same tokens (`Steps.prepare`), reduced to
MaxText-style retention bands (docs/parity.md):

  bands     the statistics, a pure function of (π_old, μ, mask)
  measure   one run's engine and trainer passes (`measure`)
  settings  the settings table: fp32, bf16, quantized weights and KV,
            MoE with and without R3, LoRA, multi-turn, exact mode
  report    the markdown table and the plot
"""
