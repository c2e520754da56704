r"""Every correction preset on a simulated training/inference mismatch.

A small bigram policy (a `[V, V]` logit table) generates sequences through a
simulated *engine* that differs from the *trainer* the way real engines do:

* `bf16`:  the engine keeps its weights and logits in bfloat16;
* `stale`: the engine samples with weights a few updates old (async RL);
* `int8`:  the engine runs per-row int8-quantised weights.

The trainer scores the same tokens in float32 (π_old), a slightly updated copy
is π_θ, and each preset's correction and actor objective run as one jitted
step with the gradient w.r.t. the policy's parameters. The table shows the
mismatch the correction measures, what it rejects, and the resulting loss.

  python -m jaxcorr.demo                                   # every preset
  python -m jaxcorr.demo --config=configs/base.py:slime_mis --mismatch=int8
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from absl import flags
from ml_collections import config_flags

from configs import base as base_config
from configs import presets
from jaxcorr import console
from jaxcorr.losses import advantages, objective, objective_config, rewards
from jaxcorr.losses import correction as corr_lib
from jaxcorr.train import build

_CONFIG = config_flags.DEFINE_config_file(
  'config',
  None,
  'Config file[:preset]; default: every preset of base.py.',
  lock_config=True,
)
_MISMATCH = flags.DEFINE_enum(
  'mismatch', 'bf16', ['none', 'bf16', 'stale', 'int8'], 'Engine mismatch.'
)
_BATCH = flags.DEFINE_integer('batch', 64, 'Sequences per batch.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 48, 'Max response tokens.')
_VOCAB = flags.DEFINE_integer('vocab', 64, 'Vocabulary size (token 0 = EOS).')
_SEED = flags.DEFINE_integer('seed', 0, 'PRNG seed.')


def engine_table(table: jax.Array, mismatch: str, key: jax.Array) -> jax.Array:
  """The logit table as the simulated engine sees it."""
  if mismatch == 'bf16':
    return table.astype(jnp.bfloat16).astype(jnp.float32)
  if mismatch == 'stale':
    return table + 0.15 * jax.random.normal(key, table.shape)
  if mismatch == 'int8':
    scale = jnp.max(jnp.abs(table), axis=-1, keepdims=True) / 127.0
    return jnp.round(table / scale).clip(-127, 127) * scale
  return table


def token_logp(table: jax.Array, prev: jax.Array, tok: jax.Array) -> jax.Array:
  """log softmax(table[prev])[tok], `[B, T]`; bf16 logits stay bf16-rounded."""
  logits = table[prev]
  return jnp.take_along_axis(
    jax.nn.log_softmax(logits, axis=-1), tok[..., None], axis=-1
  )[..., 0]


def simulate(key: jax.Array, mismatch: str, b: int, t: int, v: int) -> dict:
  """Samples a batch from the engine and scores it with the trainer."""
  k_tab, k_eng, k_theta, k_samp = jax.random.split(key, 4)
  table = 2.0 * jax.random.normal(k_tab, (v, v))
  eng = engine_table(table, mismatch, k_eng)
  if mismatch == 'bf16':
    # bf16 logits: the softmax input itself is rounded, as on real engines.
    eng_logits_of = lambda p: eng[p].astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
  else:
    eng_logits_of = lambda p: eng[p]  # noqa: E731

  def step(prev, k):
    tok = jax.random.categorical(k, eng_logits_of(prev))
    lp = jax.nn.log_softmax(eng_logits_of(prev))
    return tok, (prev, tok, jnp.take_along_axis(lp, tok[:, None], -1)[:, 0])

  start = jnp.ones((b,), jnp.int32)
  _, (prev, toks, rollout_logp) = jax.lax.scan(
    step, start, jax.random.split(k_samp, t)
  )
  prev, toks, rollout_logp = prev.T, toks.T, rollout_logp.T
  # The response ends at (and includes) the first EOS (token 0).
  eos_seen = jnp.cumsum(toks == 0, axis=1) - (toks == 0)
  mask = eos_seen == 0
  # Reward: share of even tokens; GRPO advantages with the whole batch as
  # one group (every sequence answers the same empty prompt).
  n = jnp.maximum(mask.sum(1), 1)
  reward = jnp.sum((toks % 2 == 0) & mask, 1) / n
  adv, _ = advantages.compute_advantages(
    'grpo',
    rewards.place_at_last_token(reward, mask),
    mask,
    jnp.zeros((b,), jnp.int32),
  )
  theta = table + 0.05 * jax.random.normal(k_theta, table.shape)
  return dict(
    table=table,
    theta=theta,
    prev=prev,
    toks=toks,
    mask=mask,
    old_logp=token_logp(table, prev, toks),
    rollout_logp=rollout_logp,
    advantages=adv,
  )


def make_step(actor: objective_config.ActorLossConfig, corr):
  """One jitted step: correction (decoupled) + objective + parameter grads."""

  @jax.jit
  def step(batch: dict):
    mask = batch['mask']
    decoupled = corr is not None and corr.mode == 'decoupled'
    pre = None
    if decoupled:
      pre = corr_lib.rollout_correction(
        batch['old_logp'], batch['rollout_logp'], mask, corr
      )

    def loss_fn(theta):
      logp = token_logp(theta, batch['prev'], batch['toks'])
      bypass = corr is not None and corr.mode == 'bypass'
      return objective.actor_objective(
        actor,
        corr,
        logp=logp,
        advantages=batch['advantages'],
        mask=mask,
        old_logp=None if bypass else batch['old_logp'],
        rollout_logp=None if corr is None else batch['rollout_logp'],
        correction=pre,
      )

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(
      batch['theta']
    )
    if pre is not None:
      metrics = {**metrics, **pre.metrics}
    return loss, jnp.linalg.norm(grad), metrics

  return step


COLUMNS = (
  ('kl', 'rollout_corr/kl', '{:+.1e}'),
  ('chi2_tok', 'rollout_corr/chi2_token', '{:.1e}'),
  ('ess', 'rollout_corr/rollout_is_eff_sample_size', '{:.3f}'),
  ('rej_tok', 'rollout_corr/rejected_token_fraction', '{:.1%}'),
  ('rej_seq', 'rollout_corr/rejected_seq_fraction', '{:.1%}'),
  ('clipfrac', 'actor/pg_clipfrac', '{:.3f}'),
)


def run(name: str, config, batch: dict) -> str:
  cfgs = build.losses(config)
  step = make_step(cfgs.actor, cfgs.correction)
  loss, gnorm, metrics = step(batch)  # compile + run
  t0 = time.perf_counter()
  loss, gnorm, metrics = jax.block_until_ready(step(batch))
  ms = 1e3 * (time.perf_counter() - t0)
  mode = '-' if cfgs.correction is None else cfgs.correction.mode
  cells = [
    fmt.format(float(metrics[key])) if key in metrics else '-'
    for _, key, fmt in COLUMNS
  ]
  return (
    f'{name:32s} {mode:9s} '
    + ' '.join(f'{c:>9s}' for c in cells)
    + f' {float(loss):+9.4f} {float(gnorm):8.3f} {ms:6.2f}'
  )


def main(argv: Sequence[str]) -> None:
  del argv
  batch = simulate(
    jax.random.key(_SEED.value),
    _MISMATCH.value,
    _BATCH.value,
    _SEQ_LEN.value,
    _VOCAB.value,
  )
  valid = int(batch['mask'].sum())
  print(
    f'mismatch={_MISMATCH.value}  batch={_BATCH.value}x{_SEQ_LEN.value}  '
    f'valid tokens={valid}  vocab={_VOCAB.value}'
  )
  header = ' '.join(f'{c:>9s}' for c, _, _ in COLUMNS)
  print(f'{"preset":32s} {"mode":9s} {header} {"loss":>9s} {"|grad|":>8s} ms')
  if _CONFIG.value is not None:
    print(run('(--config)', _CONFIG.value, batch))
    return
  for name in presets.PRESETS:  # add '+rollout_kl' to any via --config
    print(run(name, base_config.get_config(name), batch))


if __name__ == '__main__':
  console.run(main)
