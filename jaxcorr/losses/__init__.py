"""Pure, jit-compatible loss math: aggregation, KL, correction, policy losses.

Modules:
  masked      masked reductions, safe division, input checks (shared rules)
  aggregate   per-token values to a scalar (token_mean, seq_mean_token_mean, ...)
  kl          KL estimators k1 / abs / k2 / k3 and their straight-through `+`
  correction  rollout correction: IS weights, rejection, veto, diagnostics
  policy      the policy-loss registry (vanilla PPO, GSPO, CISPO, prime, ...)
  objective   the actor objective (pg + entropy + ref-KL + rollout-KL)
  value       the clipped critic loss
"""
