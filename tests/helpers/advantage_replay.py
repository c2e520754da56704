"""Calls of the advantage estimators and the golden layouts their replays
share (tests/conformance/*/test_advantages.py and the divergences).

Argument mapping: verl `index` strings and slime/prime groups become dense
int32 group ids; SkyRL/slime float masks become bool; slime's packed samples
are unpacked to `[B, T]` rows with `lengths` (left-aligned).
"""

from __future__ import annotations

import numpy as np

from jaxcorr.losses import advantages as adv_lib
from jaxcorr.losses import advantages_scan as scan_lib
from jaxcorr.losses import rewards as rw
from tests.helpers import golden_data as gd


def zero_outside(x, mask):
  """jaxcorr's outputs are exactly 0 outside the mask (D13)."""
  x = np.asarray(x)
  assert (x[~mask] == 0).all(), 'non-zero outside the mask (D13)'


def group_ids(index) -> np.ndarray:
  """Group labels (strings or ints) → dense int32 ids in [0, B)."""
  return np.unique(np.asarray(index), return_inverse=True)[1].astype(np.int32)


def config_fields(node: dict) -> dict:
  """A golden config node's fields, without its `$config` class tag."""
  return {k: v for k, v in node.items() if k != '$config'}


def run_estimator(estimator, rewards, mask, ids=None, **kw):
  """`(advantages, returns)` of `compute_advantages`, checked zero outside
  the mask."""
  a, r = adv_lib.compute_advantages(estimator, rewards, mask, ids, **kw)
  zero_outside(a, mask)
  zero_outside(r, mask)
  return np.asarray(a), np.asarray(r)


def verl_main():
  """verl's main dataset, its bool response mask and dense group ids."""
  d = gd.load('verl').dataset()
  return d, d['response_mask'] > 0, group_ids(d['index'])


def slime_rows(gs):
  """Per-sample lengths, the [B, T] response and loss masks, rewards, ids."""
  d = gs.dataset()
  lengths = d['lengths']
  b, t = len(lengths), d['response_mask'].shape[1]
  resp = np.arange(t)[None, :] < lengths[:, None]
  loss = unpack(d['flat_loss_mask'], lengths, t) > 0
  batch = gs.index['datasets']['main']['batch']
  rewards = np.asarray(batch['rewards'], np.float32)
  n = 4  # n_samples_per_prompt: consecutive groups (README, slime rewards)
  ids = (np.arange(b) // n * n).astype(np.int32)
  return lengths, resp, loss, rewards, ids


def unpack(flat, lengths, t) -> np.ndarray:
  """slime's packed samples -> left-aligned `[B, t]` rows."""
  out = np.zeros((len(lengths), t), np.asarray(flat).dtype)
  for i, row in enumerate(np.split(flat, np.cumsum(lengths)[:-1])):
    out[i, : len(row)] = row
  return out


def pad_rows(items, t) -> np.ndarray:
  """Ragged per-sample lists -> left-aligned float32 `[B, t]` rows."""
  out = np.zeros((len(items), t), np.float32)
  for i, row in enumerate(items):
    out[i, : len(row)] = row
  return out


def slime_pipeline(kw, resp, loss, rewards, ids, t):
  """jaxcorr's step for one slime `compute_advantages_and_returns` case."""
  est = kw['advantage_estimator']
  behaviour = kw['rollout_log_probs'] if kw['use_rollout_logprobs'] else None
  if behaviour is None:
    behaviour = kw['log_probs']
  lengths = resp.sum(-1)
  old = unpack(behaviour, lengths, t)
  ref = unpack(kw['ref_log_probs'], lengths, t)
  scores = rw.place_at_last_token(rewards, loss)
  shaped, kl, _ = rw.apply_kl_penalty(
    scores, old, ref, loss, kw['kl_coef'], estimator=kw['kl_loss_type']
  )
  norm = kw['normalize_advantages']
  if est in ('grpo', 'gspo', 'cispo'):
    a, r = run_estimator('grpo', scores, loss, ids)
    return (scan_lib.whiten(a, loss) if norm else a), r, kl
  if est == 'ppo':
    values = unpack(kw['values'], lengths, t)
    a, r = run_estimator(
      'gae', shaped, loss, values=values, gamma=kw['gamma'], lam=kw['lambd']
    )
    g = np.where(loss, r - values, 0)  # un-whitened G = returns − values
    return (a if norm else g), r, kl
  if est == 'reinforce_plus_plus':
    a, r = run_estimator('reinforce_plus_plus', shaped, loss, gamma=kw['gamma'])
    return (a if norm else r), r, kl
  # slime's reinforce_plus_plus_baseline is per token, without returns:
  # (r_i − μ_g) − β·kl_t, whitened. jaxcorr's estimator of that name is
  # verl's (test_slime_rf_baseline_is_not_verls); the slime recipe is
  # rebuilt from jaxcorr's grpo (centring), the returned kl and whiten.
  centred, _ = run_estimator('grpo', scores, loss, ids, norm_adv_by_std=False)
  tok = np.where(loss, centred - kw['kl_coef'] * np.asarray(kl), 0)
  return np.asarray(scan_lib.whiten(tok, loss)), tok, kl
