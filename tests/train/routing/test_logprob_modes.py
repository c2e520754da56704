"""An MoE policy's log-probs under every `rollout.logprob_mode`.

`jaxcorr.train.scoring.response_logp` runs one routed forward (replaying
`moe.router_replay`'s routing) and then the mode's rule. With a random
engine routing (not the policy's own), each mode must score the replayed
forward: 'truncated' with sampling that truncates nothing, and 'replay'
with kept sets holding the whole vocabulary, equal 'full'; real
truncation or smaller kept sets renormalise (log-probs rise).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from jaxcorr.model import Transformer
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build
from jaxcorr.train.policy import transformer_config
from jaxcorr.train.scoring import response_logp
from tests.helpers.step_batches import synthetic_rollout
from tests.helpers.tolerance import TOL_REORDERED_METRICS, assert_close
from tests.helpers.trainer_config import pulse_config

E, K = 8, 2


@functools.cache
def _run(mode: str):
  return build.build(
    pulse_config(
      'decoupled_token_is',
      model__architecture='MixtralForCausalLM',
      model__num_experts=E,
      model__num_experts_per_tok=K,
      moe__router_replay='rollout',
      rollout__logprob_mode=mode,
    )
  )


def _rollout(num_layers: int, vocab: int, kept_width: int, top_k: int = 0):
  """synthetic_rollout with a random routing and kept sets: the sampled
  token and the `kept_width` - 1 lowest other ids (all ids: the vocab)."""
  rb, rew = synthetic_rollout()
  rng = np.random.default_rng(5)
  b, t = rb.response_tokens.shape
  s = rb.prompt_tokens.shape[1] + t
  routed = np.argsort(rng.random((b, s, num_layers, E)), -1)[..., :K]
  y = rb.response_tokens[..., None]
  others = np.broadcast_to(np.arange(vocab), (b, t, vocab))
  others = np.sort(np.where(others == y, vocab, others), -1)[..., :-1]
  ids = np.concatenate([y, others[..., : kept_width - 1]], -1)
  rb = rb.replace(
    routed_experts=routed.astype(np.int32),
    top_k=np.full(b, top_k, np.int32),
    kept_ids=ids.astype(np.int32),
    kept_count=np.full((b, t), kept_width, np.int32),
    kept_capped=np.zeros((b, t), bool),
  )
  return rb, rew


@functools.cache
def _scorer(mode: str, graphdef):
  """The jitted `response_logp` of `mode` (one compile per mode)."""
  run = _run(mode)
  return jax.jit(
    lambda p, b: response_logp(run, graphdef, p, b, entropy=True, routing=True)
  )


def _score(mode, graphdef, params, rb, rew):
  host = batch_lib.assemble(
    rb,
    rew,
    trainer_version=0,
    max_staleness=None,
    logprob_mode=mode,
    row_multiple=1,
  )
  batch = jax.tree.map(jax.numpy.asarray, host)
  (logp, ent), stats = jax.device_get(_scorer(mode, graphdef)(params, batch))
  return logp, ent, stats, np.asarray(host.response_mask, bool)


def test_every_logprob_mode_scores_the_replayed_forward():
  cfg = transformer_config(_run('full').model)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  v, layers = cfg.vocab_size, len(cfg.moe_layers)
  whole = _rollout(layers, v, v)
  lp, ent, stats, mask = _score('full', graphdef, params, *whole)
  # The forward replayed the engine's (random) routing on every real token.
  real = np.asarray(
    batch_lib.assemble(
      *whole,
      trainer_version=0,
      max_staleness=None,
      logprob_mode='full',
      row_multiple=1,
    ).segment_ids
    != 0
  )
  np.testing.assert_array_equal(
    np.asarray(stats.experts)[real], whole[0].routed_experts[real]
  )
  for mode in ('truncated', 'replay'):
    got, got_ent, got_stats, _ = _score(mode, graphdef, params, *whole)
    assert_close(got, lp, TOL_REORDERED_METRICS, mask=mask, what=mode)
    assert_close(got_ent, ent, TOL_REORDERED_METRICS, mask=mask, what=mode)
    np.testing.assert_array_equal(got_stats.experts, stats.experts)
  # Real truncation (top-3 sampling; kept sets of 3): renormalised.
  for mode, rollout in (
    ('truncated', _rollout(layers, v, v, top_k=3)),
    ('replay', _rollout(layers, v, 3)),
  ):
    got, *_ = _score(mode, graphdef, params, *rollout)
    assert (got[mask] >= lp[mask] - 1e-6).all(), mode
    assert (got[mask] > lp[mask] + 1e-3).mean() > 0.5, mode
