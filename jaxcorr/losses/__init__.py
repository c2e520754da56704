"""Pure, jit-compatible loss math: aggregation, KL, correction, policy losses.

Modules:
  masked              masked reductions, safe division, input checks (shared rules)
  aggregate           per-token values to a scalar (token_mean, seq_mean_token_mean, ...)
  kl                  KL estimators k1 / abs / k2 / k3 and their straight-through `+`
  correction_config   CorrectionConfig: validated, hashable correction settings
  correction          rollout correction: IS weights, rejection, veto
  correction_metrics  the `rollout_corr/` diagnostics
  policy              the policy-loss registry, knobs and dispatcher
  policy_ppo          ratio-clipped losses (vanilla, gspo, sapo, cispo, clip_cov, ...)
  policy_pg           log-prob gradient losses (gpg, reinforce, dro, rollout_is, prime)
  policy_base         shared inputs and helpers of the policy losses
  objective           the actor objective (pg + entropy + ref-KL + rollout-KL)
  value               the clipped critic loss
  advantages          group advantage estimators (grpo, rloo, opo, maxrl, ...)
  advantages_scan     recursions over time: gae, reinforce++, remax, whitening
  rewards             reward placement, KL in reward, KL controllers
"""
