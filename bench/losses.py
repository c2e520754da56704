"""Speed of the jitted correction + policy-loss pipelines (issue: correction core).

Measures, side by side in one run (this machine is shared and noisy, so only
ratios taken in the same run mean anything):

  (a) decoupled: `decoupled_geo_rs_token_tis` correction on (old, rollout)
      + vanilla PPO token_mean on the corrected mask × weights, forward and
      backward w.r.t. logp, every metric returned;
  (b) bypass: the `bypass_pg_geo_rs_token_tis` actor objective (correction
      inside the loss, REINFORCE with token TIS), forward and backward;
  (i) the same math in NumPy (forward, hand-written backward, same metrics);
  (ii) a memory floor: one jitted pass that reads every input once and
      reduces it to a scalar.

Usage: python bench/losses.py [--batch 256] [--tokens 2048] [--repeats 15] [--no-numpy]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcorr.losses import correction as corr_lib
from jaxcorr.losses import objective as obj_lib
from jaxcorr.losses import objective_config
from jaxcorr.losses import policy as policy_lib

GEO_RS = dict(rs=('seq_mean_k1',), rs_bounds=((0.999, 1.001),))
TIS = dict(is_level='token', is_mode='truncate', is_upper=2.0)


def make_batch(b: int, t: int, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  lengths = rng.integers(t // 4, t + 1, size=b)
  mask = np.arange(t)[None, :] < lengths[:, None]
  rollout = -np.abs(rng.normal(1.0, 1.0, (b, t))).astype(np.float32)
  # Small mismatch so that the geometric filter keeps a fraction of rows.
  old = rollout + rng.normal(0, 2e-3, (b, t)).astype(np.float32)
  logp = old + rng.normal(0, 0.05, (b, t)).astype(np.float32)
  adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1).astype(np.float32)
  return dict(logp=logp, old=old, rollout=rollout, adv=adv, mask=mask)


# ------------------------------------------------------------------- jax


def jax_pipelines():
  dec_cfg = corr_lib.CorrectionConfig(mode='decoupled', **TIS, **GEO_RS)
  byp_cfg = corr_lib.CorrectionConfig(
    mode='bypass', bypass_loss='reinforce', **TIS, **GEO_RS
  )
  actor = objective_config.ActorLossConfig(
    policy_loss='reinforce', agg='token_mean'
  )

  @jax.jit
  def decoupled(logp, old, rollout, adv, mask):
    corr = corr_lib.rollout_correction(old, rollout, mask, dec_cfg)

    def loss(lp):
      return policy_lib.policy_loss(
        'vanilla',
        lp,
        old,
        adv,
        corr.mask,
        is_weights=corr.weights,
        agg='token_mean',
      )

    (val, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
    return val, grad, {**metrics, **corr.metrics}

  @jax.jit
  def bypass(logp, old, rollout, adv, mask):
    del old  # bypass mode needs no π_old forward pass

    def loss(lp):
      return obj_lib.actor_objective(
        actor, byp_cfg, logp=lp, advantages=adv, mask=mask, rollout_logp=rollout
      )

    (val, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
    return val, grad, metrics

  @jax.jit
  def floor(logp, old, rollout, adv, mask):
    return (
      jnp.sum(logp) + jnp.sum(old) + jnp.sum(rollout) + jnp.sum(adv)
    ) + jnp.sum(mask, dtype=jnp.float32)

  # Same steps with the diagnostics dropped (XLA removes their reductions):
  # shows how the time splits between the update path and the ~50 metrics.
  decoupled_core = jax.jit(lambda *a: decoupled(*a)[:2])
  bypass_core = jax.jit(lambda *a: bypass(*a)[:2])
  return decoupled, bypass, floor, decoupled_core, bypass_core


def batch_passes(fn, args, shape: tuple[int, int]) -> int:
  """The `[B, T]` arrays `fn`'s compiled program writes: the fusions of its
  entry computation whose result has the batch's shape.

  On XLA:CPU a reduction runs in a library kernel that cannot fuse its
  elementwise producer, so every distinct masked quantity reduced over the
  batch is written out as one such array first (docs/benchmarks.md, "The
  loss core: one written [B, T] array per diagnostic").
  """
  text = jax.jit(fn).lower(*args).compile().as_text()
  entry = text[text.index('ENTRY') :]
  dims = ','.join(map(str, shape))
  return len(re.findall(rf'= \w+\[{dims}\]\S* fusion\(', entry))


def row_sums(k: int):
  """`k` masked row sums of `k` distinct transcendentals of the inputs: the
  shape of the diagnostics' work, each sum one `[B, T]` pass. The time of
  `row_sums(9)` less `row_sums(1)`, over 8, is what one more pass costs
  inside a program."""

  @jax.jit
  def fn(logp, old, rollout, adv, mask):
    del logp, adv
    return [
      jnp.sum(jnp.where(mask, jnp.exp(old - (1 + j / 64) * rollout), 0), -1)
      for j in range(k)
    ]

  return fn


# ----------------------------------------------------------------- numpy


def _np_rmean(x, m):
  n = m.sum(-1)
  return np.where(n > 0, (x * m).sum(-1) / np.maximum(n, 1), 0.0)


def _np_vstats(y, v):
  if not v.any():
    return 0.0, 0.0, 0.0, 0.0
  yv = y[v]
  std = yv.std(ddof=1) if yv.size > 1 else 0.0
  return yv.mean(), std, yv.max(), yv.min()


def np_correction(train, rollout, mask, is_upper=2.0, lo=0.999, up=1.001):
  """NumPy twin of the decoupled/bypass geo-RS + token-TIS correction."""
  finite = np.isfinite(train) & np.isfinite(rollout)
  bad = (mask & ~finite).any(-1)
  m = mask & ~bad[:, None]
  mf = m.astype(np.float32)
  r = np.where(m, train, 0) - np.where(m, rollout, 0)
  rc = np.clip(r, -20, 20)
  n = mf.sum()
  rows = m.any(-1)
  mmean = lambda x: (x * mf).sum() / max(n, 1)  # noqa: E731
  raw = np.exp(rc) * mf
  w = np.minimum(raw, is_upper)
  k1 = -rc
  stat = _np_rmean(k1, mf)
  keep = (stat >= -np.log(up)) & (stat <= -np.log(lo))
  out = m & keep[:, None]
  weights = np.where(out, w, 0)
  met = {}
  t_lp, r_lp = _np_rmean(train, mf), _np_rmean(rollout, mf)
  d = r_lp - t_lp
  met['training_log_ppl'] = np.mean(-t_lp[rows])
  met['training_ppl'] = np.mean(np.exp(-t_lp[rows]))
  met['rollout_log_ppl'] = np.mean(-r_lp[rows])
  met['rollout_ppl'] = np.mean(np.exp(-r_lp[rows]))
  met['kl'] = mmean(-r)
  met['k3_kl'] = mmean(np.exp(rc) - rc - 1)
  met['log_ppl_diff'], _, met['log_ppl_diff_max'], met['log_ppl_diff_min'] = (
    _np_vstats(d, rows)
  )
  met['log_ppl_abs_diff'] = np.mean(np.abs(d[rows]))
  met['ppl_ratio'] = np.mean(np.exp(np.clip(d[rows], -20, 20)))
  met['chi2_token'] = mmean(np.exp(2 * rc)) - 1
  s = (r * mf).sum(-1)
  met['chi2_seq'] = np.mean(np.exp(2 * np.clip(s[rows], -20, 20))) - 1
  met['rollout_is_mean'] = mmean(w)
  met['rollout_is_max'] = w[m].max()
  met['rollout_is_min'] = w[m].min()
  met['rollout_is_ratio_fraction_high'] = mmean(raw > is_upper)
  met['rollout_is_ratio_fraction_low'] = mmean(raw < 1 / is_upper)
  wc = np.clip(w, 0, is_upper)
  met['rollout_is_std'] = np.sqrt(max(mmean(wc**2) - mmean(wc) ** 2, 0))
  met['rollout_is_eff_sample_size'] = 1 / mmean((wc / (mmean(wc) + 1e-8)) ** 2)
  q = _np_rmean(w, mf)
  (
    met['rollout_is_seq_mean'],
    met['rollout_is_seq_std'],
    met['rollout_is_seq_max'],
    met['rollout_is_seq_min'],
  ) = _np_vstats(q, rows)
  met['rollout_is_seq_max_deviation'] = np.abs(q[rows] - 1).max()
  qr = _np_rmean(raw, mf)
  met['rollout_is_seq_fraction_high'] = np.mean(qr[rows] > is_upper)
  met['rollout_is_seq_fraction_low'] = np.mean(qr[rows] < 1 / is_upper)
  qv = q[rows]
  met['rollout_is_seq_eff_sample_size'] = qv.sum() ** 2 / (
    qv.size * (qv**2).sum()
  )
  lo_s, up_s = -np.log(up), -np.log(lo)
  sb = np.broadcast_to(stat[:, None], m.shape)
  met['rs_mean'] = mmean(sb)
  met['rs_seq_mean'], met['rs_seq_std'], met['rs_max'], met['rs_min'] = (
    _np_vstats(stat, rows)
  )
  met['rs_fraction_high'] = np.mean(stat[rows] > up_s)
  met['rs_fraction_low'] = np.mean(stat[rows] < lo_s)
  x = np.clip(sb, lo_s, up_s)
  met['rs_std'] = np.sqrt(max(mmean(x**2) - mmean(x) ** 2, 0))
  met['rs_seq_max_deviation'] = np.abs(stat[rows]).max()
  met['rs_masked_fraction'] = mmean(~keep[:, None] & m)
  met['rs_seq_masked_fraction'] = np.mean(~keep[rows])
  met['rejected_token_fraction'] = 1 - out.sum() / max(mask.sum(), 1)
  met['rejected_seq_fraction'] = np.mean((mask & ~out).any(-1)[mask.any(-1)])
  return weights, out, met


def np_decoupled(logp, old, rollout, adv, mask, eps=0.2, c=3.0):
  weights, out, met = np_correction(old, rollout, mask)
  outf = out.astype(np.float32)
  a = np.where(out, adv, 0)
  delta = np.where(out, logp, 0) - np.where(out, old, 0)
  dc = np.clip(delta, -20, 20)
  rho = np.exp(dc)
  l1 = -a * rho
  l2 = -a * np.clip(rho, 1 - eps, 1 + eps)
  lc = np.maximum(l1, l2)
  l3 = -a * c
  neg = a < 0
  use3 = neg & (l3 < lc)
  per_tok = np.where(use3, l3, lc) * weights
  n = max(outf.sum(), 1)
  loss = (per_tok * outf).sum() / n
  # d loss / d logp: only the unclipped L1 / L2 branches carry ρ's gradient.
  in_band = (rho > 1 - eps) & (rho < 1 + eps)
  from_l1 = l1 >= l2
  d_lc = np.where(from_l1, -a * rho, np.where(in_band, -a * rho, 0))
  d_lc = d_lc * (np.abs(delta) < 20)
  grad = np.where(use3, 0, d_lc) * weights * outf / n
  met['pg_clipfrac'] = (outf * (l2 > l1)).sum() / n
  met['pg_clipfrac_lower'] = (outf * (neg & (lc > l3))).sum() / n
  met['ppo_kl'] = (outf * -dc).sum() / n
  return loss, grad, met


def np_bypass(logp, old, rollout, adv, mask):
  del old
  weights, out, met = np_correction(logp, rollout, mask)
  outf = out.astype(np.float32)
  n = max(outf.sum(), 1)
  a = np.where(out, adv, 0)
  lp = np.where(out, logp, 0)
  loss = (-a * lp * weights * outf).sum() / n
  grad = -a * weights * outf / n
  met['ppo_kl'] = (outf * (np.where(out, rollout, 0) - lp)).sum() / n
  return loss, grad, met


# ------------------------------------------------------------------ main


def _time(fn, args, block) -> float:
  t0 = time.perf_counter()
  out = fn(*args)
  if block:
    jax.block_until_ready(out)
  return time.perf_counter() - t0


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--batch', type=int, default=256)
  p.add_argument('--tokens', type=int, default=2048)
  p.add_argument('--repeats', type=int, default=15)
  p.add_argument(
    '--no-numpy',
    action='store_true',
    help='skip the NumPy twin (its check and timing): at accelerator sizes '
    '(e.g. --batch 4096 --tokens 16384) it takes minutes',
  )
  args = p.parse_args()
  b, t = args.batch, args.tokens
  host = make_batch(b, t)
  names = ('logp', 'old', 'rollout', 'adv', 'mask')
  dev = [jnp.asarray(host[k]) for k in names]
  nps = [host[k] for k in names]
  decoupled, bypass, floor, decoupled_core, bypass_core = jax_pipelines()

  # Agreement check before timing: the NumPy twin must compute the same.
  checks = (
    () if args.no_numpy else ((decoupled, np_decoupled), (bypass, np_bypass))
  )
  for jfn, nfn in checks:
    jl, jg, _ = jfn(*dev)
    nl, ng, _ = nfn(*nps)
    np.testing.assert_allclose(jl, nl, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(jg, ng, rtol=2e-4, atol=1e-9)

  variants = {
    'decoupled (jax)': (decoupled, dev, True),
    'bypass (jax)': (bypass, dev, True),
    'memory floor (jax)': (floor, dev, True),
    'decoupled, no metrics': (decoupled_core, dev, True),
    'bypass, no metrics': (bypass_core, dev, True),
    # Last, so the rows above keep the cache state they had without them.
    '1 masked row sum': (row_sums(1), dev, True),
    '9 masked row sums': (row_sums(9), dev, True),
  }
  if not args.no_numpy:
    variants['decoupled (numpy)'] = (np_decoupled, nps, False)
    variants['bypass (numpy)'] = (np_bypass, nps, False)
  for fn, a, block in variants.values():  # warm-up / compile
    _time(fn, a, block)
  samples = {k: [] for k in variants}
  with jax.transfer_guard('disallow'):
    for _ in range(args.repeats):  # interleaved: same noise for everyone
      for k, (fn, a, block) in variants.items():
        if block:
          samples[k].append(_time(fn, a, block))
  for _ in range(max(3, args.repeats // 3)):
    for k, (fn, a, block) in variants.items():
      if not block:
        samples[k].append(_time(fn, a, block))
  ms = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
  tokens = int(host['mask'].sum())
  print(f'B={b} T={t} valid tokens={tokens} fp32, {jax.devices()[0].platform}')
  for k, v in ms.items():
    print(f'  {k:22s} {v:9.2f} ms  {tokens / v * 1e3 / 1e6:8.1f} Mtok/s')
  floor_ms = ms['memory floor (jax)']
  pass_ms = (ms['9 masked row sums'] - ms['1 masked row sum']) / 8
  fns = dict(
    decoupled=(decoupled, decoupled_core), bypass=(bypass, bypass_core)
  )
  for mode in ('decoupled', 'bypass'):
    j, core = ms[f'{mode} (jax)'], ms[f'{mode}, no metrics']
    n = ms.get(f'{mode} (numpy)')
    vs_numpy = '' if n is None else f'{n / j:6.1f}x faster than NumPy; '
    print(
      f'  {mode:9s}: {j / floor_ms:5.2f}x the memory floor, {vs_numpy}'
      f'without metrics {core / floor_ms:5.2f}x the floor'
    )
    with_m, without = (batch_passes(f, dev, (b, t)) for f in fns[mode])
    written = f'writes {with_m} [B, T] arrays with metrics, {without} without'
    if with_m > without:
      print(
        f'  {mode:9s}: {written}; one more masked row sum costs '
        f'{pass_ms / floor_ms:.2f}x the floor, so the {with_m - without} '
        f'the metrics add cost ~{(with_m - without) * pass_ms / floor_ms:.1f}x'
        f' (measured: {(j - core) / floor_ms:.1f}x)'
      )
    else:  # the reductions fuse their producers (XLA:GPU): no array model
      print(
        f'  {mode:9s}: {written} (reductions fuse their producers); the '
        f'metrics cost {(j - core) / floor_ms:.1f}x the floor'
      )
    # train.metrics_every=N: one step in N computes the diagnostics
    # (jaxcorr/train/tracker/diagnostics.py); the mean cost per step.
    for every in (10,):
      mean = (j + (every - 1) * core) / every
      print(
        f'  {mode:9s}: with metrics_every={every}: '
        f'{mean / floor_ms:5.2f}x the floor per step on average'
      )


if __name__ == '__main__':
  main()
