"""The engine's quantization as the trainer sees it
(jaxcorr/train/rollouts/weights.py): the matched-precision π_old weights
are exactly the engine's dequantized weights, the published copy stays in
the trainer's precision (quantized weights are derived, never
checkpointed), and quantized runs train in sync, fixed-lag and stream
modes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.model import quantized_weights as qw
from jaxcorr.rollout import precision
from jaxcorr.train import build
from jaxcorr.train.loop import Trainer
from jaxcorr.train.rollouts import weights
from tests.helpers.model_testing import random_model, tiny_config
from tests.helpers.trainer_config import pulse_config


def _run(**rollout):
  cfg = pulse_config(**{f'rollout__{k}': v for k, v in rollout.items()})
  return build.build(cfg)


def test_matched_params_are_the_engines_dequantized_weights():
  run = _run(quantization='fp8', matched_precision=True)
  model = random_model(tiny_config())
  graphdef, state = nnx.split(model)
  spec = weights.quant_spec(run.rollout)
  assert spec == qw.QuantSpec('fp8')
  matched = jax.jit(lambda s: weights.matched_params(run, graphdef, s))(state)
  engine = precision.EngineQuantizer(graphdef, spec)(state)
  deq = qw.dequantize_state(engine, jnp.float32)
  for a, b in zip(jax.tree.leaves(matched), jax.tree.leaves(deq)):
    np.testing.assert_array_equal(a, b)


def test_published_copy_stays_full_precision():
  run = _run(quantization='int8', kv_cache_dtype='int8')
  state = nnx.state(random_model(tiny_config()))
  copy = weights.engine_params(run, state)
  for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(state)):
    assert a.dtype == b.dtype == jnp.float32
    np.testing.assert_array_equal(a, b)


def test_bypass_cannot_match_precision():
  cfg = pulse_config(
    'bypass_pg_geo_rs',
    rollout__quantization='int8',
    rollout__matched_precision=True,
  )
  with pytest.raises(ValueError, match=r'config\.rollout\.matched_precision'):
    build.build(cfg)


MODES = {
  'sync': {},
  'async': dict(mode='async', max_staleness=1),
  'stream': dict(mode='stream', max_staleness=2, queue_size=2, decode_chunk=2),
}


@pytest.mark.slow
@pytest.mark.parametrize('mode', list(MODES))
def test_quantized_rollouts_train_in_every_mode(mode, tmp_path):
  rollout = dict(
    quantization='int8',
    kv_cache_dtype='int8',
    matched_precision=True,
    **MODES[mode],
  )
  cfg = pulse_config(
    'decoupled_token_is',
    length_reward=True,
    train__num_steps=3,
    train__eval_every=0,
    train__checkpoint_every=0,
    **{f'rollout__{k}': v for k, v in rollout.items()},
  )
  trainer = Trainer.from_config(cfg, str(tmp_path), config_name='test')
  trainer.train()
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rows = [r for r in rows if r['step'] > 0]
  assert len(rows) == 3
  for r in rows:
    assert np.isfinite(r['rollout_corr/kl'])
