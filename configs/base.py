"""Library defaults: every loss and correction field, with a preset on top.

Usage::

  --config=configs/base.py                      # preset 'disabled'
  --config=configs/base.py:decoupled_token_is   # any preset of presets.py
  --config=configs/base.py:bypass_ppo_clip+rollout_kl
  --config.correction.is_lower=0.5 --config.correction.rs=token_k1,seq_max_k3

Sections:

* `correction`: every `CorrectionConfig` field (spec correction.md §3) plus
  `enabled`. `enabled=False` turns the whole correction off
  (`CorrectionConfig | None` is None): no correction runs, no diagnostic is
  logged and no rollout log-prob is needed. This is different from the
  `disabled` preset, which changes nothing in the update but still computes
  every diagnostic, and therefore needs rollout log-probs.
* `actor`: every `ActorLossConfig` field (losses.md §4.4 and §5).
* `algorithm`: advantages and KL in reward (`configs/algorithm.py`).
* `model`, `data`, `rollout`, `reward`, `train`, `optim`, `critic`, `mesh`:
  the trainer (`configs/trainer.py`, docs/training.md).

Decision: the issue that asked for these configs calls the actor section
"loss"; the spec calls its fields `actor.*` (`actor.policy_loss`,
`actor.rollout_kl_coef` in the preset table), so the section is `actor`. The
critic has its own section (`configs/trainer.py`).

Conventions:

* Fields that may be None are typed placeholders
  (`config_dict.placeholder(float)`), so a CLI override such as
  `--config.correction.is_lower=0.5` is parsed with the right type.
* absl parses a float override as a float, so None cannot be typed for a
  float field: `--config.actor.clip_ratio_c=inf` switches the dual clip off
  (the same loss as None); the optional strings `is_level` and `agg` accept
  `none`.
* `correction.rs` and `correction.rs_bounds` are verl's comma-separated
  strings (`'token_k1,seq_max_k3'`, `'0.5_2.0,0.01'`); `''` means none.
* The config is locked: a typo in an override fails instead of adding a key.
* `jaxcorr.loss_config.build(config)` turns the sections into the frozen
  dataclasses and runs every validation at start-up.

To extend: add a `<name>_section()` function returning a ConfigDict and
assign it in `base_config` (a preset may then override its fields too). A
task config starts from `base_config()`, sets its own fields, and applies
the preset named by its config string the same way `get_config` does.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections
from ml_collections import config_dict

from configs import presets, trainer
from configs.algorithm import algorithm_section


def correction_section() -> ml_collections.ConfigDict:
  """`CorrectionConfig` fields, at the library defaults (correction.md §3)."""
  c = ml_collections.ConfigDict()
  # False: no correction at all (corr_cfg=None, rollout log-probs not needed).
  c.enabled = True
  # 'decoupled' (π_old forward pass, IS = π_old/μ) or 'bypass' (old := μ).
  c.mode = 'decoupled'
  # Bypass only: 'ppo_clip' (any loss but reinforce) or 'reinforce'.
  c.bypass_loss = 'ppo_clip'
  # None (no IS weights; CLI: none), 'token', 'sequence' or 'geometric'.
  c.is_level = config_dict.placeholder(str)
  # 'truncate' min(w, Cu), 'clip' clip(w, Cl, Cu), 'mask' w in [Cl, Cu] else 0.
  c.is_mode = 'truncate'
  # Cu, the upper IS bound (> 0).
  c.is_upper = 2.0
  # Cl, the lower IS bound; None means 1/Cu.
  c.is_lower = config_dict.placeholder(float)
  # Rescale the IS weights to mean 1 (needs is_level).
  c.is_batch_normalize = False
  # Rejection criteria, comma-separated, ANDed; '' for none.
  c.rs = ''
  # One bound per criterion (or one for all), comma-separated: k1 'lo_up' or
  # 'up' (lo = 1/up), k2/k3 'up'; '' for none.
  c.rs_bounds = ''
  # τ_lo in (0, 1): a valid token with ρ < τ_lo rejects its whole sequence.
  c.veto_low = config_dict.placeholder(float)
  # τ_hi > 1: a valid token with ρ > τ_hi rejects its whole sequence.
  c.veto_high = config_dict.placeholder(float)
  return c


def actor_section() -> ml_collections.ConfigDict:
  """`ActorLossConfig` fields, at the library defaults (losses.md §4.4, §5)."""
  a = ml_collections.ConfigDict()
  # Policy loss (losses.md §4.2): vanilla, gspo, gspo_seq, sapo, gpg, cispo,
  # clip_cov, kl_cov, geo_mean, dro, dppo_tv, dppo_kl, reinforce, rollout_is,
  # prime; stale / μ-anchored data (losses/policy_stale.py): cispo_rollout,
  # dppo_mu_tv, dppo_mu_kl, m2po, topr.
  a.policy_loss = 'vanilla'
  # Aggregation: token_mean, token_sum, seq_mean_token_sum,
  # seq_mean_token_mean, seq_mean_token_sum_norm (or verl's hyphenated form);
  # None (CLI: none) is the loss's natural mode, and token_mean for the
  # entropy and KL terms.
  a.agg = config_dict.placeholder(str)
  # ε_l >= 0, lower PPO clip (vanilla, gspo, gspo_seq, clip_cov, geo_mean,
  # rollout_is; fallback of cispo and dppo).
  a.clip_ratio_low = 0.2
  # ε_h >= 0, upper PPO clip (same losses as clip_ratio_low).
  a.clip_ratio_high = 0.2
  # Dual-clip constant c > 1 (vanilla; fallback of dppo_ratio_cap); None
  # (CLI: inf) turns the dual clip off.
  a.clip_ratio_c = config_dict.FieldReference(3.0, field_type=float)
  # SAPO temperature for positive advantages (> 0).
  a.tau_pos = 1.0
  # SAPO temperature for negative advantages (> 0).
  a.tau_neg = 1.05
  # clip_cov: fraction of tokens exempted from the gradient (> 0).
  a.clip_cov_ratio = 2e-4
  # clip_cov: lower end of the covariance band (< clip_cov_ub).
  a.clip_cov_lb = 1.0
  # clip_cov: upper end of the covariance band (> clip_cov_lb).
  a.clip_cov_ub = 5.0
  # kl_cov: fraction of top-covariance tokens that get the |δ| penalty (> 0).
  a.kl_cov_ratio = 2e-4
  # kl_cov: coefficient of the |δ| penalty (>= 0).
  a.ppo_kl_coef = 0.1
  # dro: β of the squared log-ratio penalty; required (> 0) by dro.
  a.dro_beta = config_dict.placeholder(float)
  # dppo_tv / dppo_kl: lower threshold δ_l > 0; None falls back to ε_l.
  a.dppo_delta_low = config_dict.placeholder(float)
  # dppo_tv / dppo_kl: upper threshold δ_h > 0; None falls back to ε_h.
  a.dppo_delta_high = config_dict.placeholder(float)
  # dppo_tv / dppo_kl: ratio cap c_d > 0; None falls back to clip_ratio_c.
  a.dppo_ratio_cap = config_dict.placeholder(float)
  # cispo: lower ratio bound κ_l >= 0; None falls back to ε_l.
  a.cispo_clip_low = config_dict.placeholder(float)
  # cispo: upper ratio bound κ_h >= 0; None falls back to ε_h.
  a.cispo_clip_high = config_dict.placeholder(float)
  # prime: mask a token when π_θ − μ < −prime_mask_low and A <= 0 (> 0).
  a.prime_mask_low = 0.2
  # prime: mask a token when π_θ − μ > prime_mask_high and A > 0 (> 0).
  a.prime_mask_high = 0.2
  # prime: advantage scale τ_A.
  a.prime_adv_tau = 1.0
  # prime: coefficient τ_KL >= 0 of (log π_θ − log μ)².
  a.prime_kl_tau = 1e-3
  # m2po: budget (>= 0) on the mean squared log-ratio of harmful tokens.
  a.m2_budget = 0.04
  # m2po: the lower ratio bound is at most 1 − low (>= 0); None: no floor.
  a.m2po_miniclip_low = config_dict.placeholder(float)
  # m2po: the upper ratio bound is at least 1 + high (>= 0); None: no floor.
  a.m2po_miniclip_high = config_dict.placeholder(float)
  # topr: lower clip (>= 0) of the taper weight of negative-advantage rows.
  a.topr_negative_ratio_lower = 0.0
  # topr: upper clip (> 0) of the taper weight of negative-advantage rows.
  a.topr_negative_ratio_upper = 1.0
  # Entropy bonus: loss −= entropy_coeff · H (needs the entropy array).
  a.entropy_coeff = 0.0
  # Reference-KL estimator: k1 (kl), abs, k2 (mse), k3 (low_var_kl), or any
  # of them with a trailing + (its value, k2's gradient).
  a.kl_loss_type = 'low_var_kl'
  # Reference-KL coefficient (>= 0); 0 turns the term off.
  a.kl_loss_coef = 0.0
  # Rollout-KL estimator; k2 is ½(log π_θ − log μ)² (losses.md §6).
  a.rollout_kl_type = 'k2'
  # Rollout-KL coefficient (>= 0); 0 turns the term off.
  a.rollout_kl_coef = 0.0
  return a


def base_config() -> ml_collections.ConfigDict:
  """Every section at the library defaults: unlocked, no preset applied.

  Task configs start from here, add or change their own fields, then call
  `presets.apply_preset(config, config_string)` and `config.lock()`, exactly
  as `get_config` below does.
  """
  config = ml_collections.ConfigDict()
  config.correction = correction_section()
  config.actor = actor_section()
  config.algorithm = algorithm_section()
  config.model = trainer.model_section()
  config.data = trainer.data_section()
  config.rollout = trainer.rollout_section()
  config.reward = trainer.reward_section()
  config.train = trainer.train_section()
  config.optim = trainer.optim_section()
  config.critic = trainer.critic_section()
  config.mesh = trainer.mesh_section()
  return config


def get_config(
  config_string: str | None = None,
  *,
  task: Callable[[ml_collections.ConfigDict], None] | None = None,
) -> ml_collections.ConfigDict:
  """The base config, then a task config's values (`task(config)`, which
  changes values, never keys), then preset `config_string` (None:
  disabled), locked. Every task config's `get_config` is this with its own
  `task`."""
  config = base_config()
  if task is not None:
    task(config)
  presets.apply_preset(config, config_string)
  config.lock()
  return config
