"""Pure, jit-compatible loss math: aggregation, KL, correction, policy losses,
the actor and critic objectives, advantages and rewards.

Modules and packages:
  masked            masked reductions, safe division, input checks (shared rules)
  aggregate         per-token values to a scalar (token_mean, seq_mean_token_mean, ...)
  kl                KL estimators k1 / abs / k2 / k3 and their straight-through `+`
  correction/       the rollout correction; face: CorrectionConfig, Correction,
                    rollout_correction, gap_metric_weights, METRIC_PREFIX
    config          CorrectionConfig: validated, hashable correction settings
    apply           rollout_correction: the entry that applies the three below
    weights         raw, bounded and batch-normalised IS weights
    rejection       the rejection-statistic registry (k1/k2/k3, KPop bkl,
                    NeMo mpe), RS criteria and levels, veto
    seq_error       NeMo-RL's sequence log-prob error mask on its own
    metrics         the `rollout_corr/` diagnostics
  policy/           the policy losses; face: policy_loss, check_knobs,
                    PolicyKnobs, LossInputs, LOSSES and its views
    registry        the registry, the knob checks and the dispatcher
    inputs          LossInputs and PolicyKnobs (every loss's two arguments)
    ratio           trust-region surrogates of the ratio (vanilla, gspo, sapo,
                    clip_cov, kl_cov, geo_mean, dppo, dppo_mu, m2po)
    logprob         −c·A·logp losses (gpg, reinforce, dro, rollout_is, prime,
                    cispo, cispo_rollout, topr)
  objective_config  ActorLossConfig and its checks against a CorrectionConfig
  objective         the actor objective (pg + entropy + ref-KL + rollout-KL)
  value             the clipped critic loss
  advantages        group advantage estimators (grpo, rloo, opo, maxrl, ...)
  advantages_scan   recursions over time: gae, reinforce++, remax, whitening
  rewards           reward placement, KL in reward, KL controllers
"""
