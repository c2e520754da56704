"""The direct distillation losses through the jitted step
(jaxcorr/train/distill/direct.py): `Steps.prepare` fills the teacher's
fields, `Steps.update` adds the library loss on the current student.

One synthetic batch (tests/helpers/step_batches.py), the pulse model's
shape, one device; the teacher is the student's own params (teacher ==
student) or another init."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr.losses import distill as distill_loss
from jaxcorr.model import Transformer
from jaxcorr.train import batch as batch_lib
from jaxcorr.train import build, scoring
from jaxcorr.train.distill import DistillConfig, direct
from jaxcorr.train.distill.teacher import Teacher
from jaxcorr.train.policy import transformer_config
from tests.helpers.model_testing import fresh_train_state
from tests.helpers.step_batches import one_device_mesh, step_arrays
from tests.helpers.tolerance import TOL_LAYOUT_METRICS, assert_close
from tests.helpers.trainer_config import pulse_config

# (name, distill fields): every direct mode; topk 4 < V = 27 keeps a rest
# of the vocabulary off the support, topk 64 covers it whole.
MODES = {
  'reverse_kl_k1': dict(loss='reverse_kl', estimator='k1'),
  'reverse_kl_k3': dict(loss='reverse_kl', estimator='k3'),
  'topk_forward': dict(loss='topk_kl', topk=4),
  'topk_reverse_full': dict(loss='topk_kl', topk=64, topk_direction='reverse'),
  'gjsd_rest': dict(loss='gjsd', topk=4, beta=0.5),
  'gjsd_full': dict(loss='gjsd', topk=64, beta=0.1),
}


def _run(**distill):
  config = pulse_config(
    train__shuffle_minibatches=False,
    train__mini_batches=1,
    train__micro_batches=2,
    train__ppo_epochs=1,
  )
  run = build.build(config)  # the teacher's path is not checked below
  cfg = DistillConfig(teacher='in-memory', coef=0.5, **distill)
  return dataclasses.replace(run, distill=cfg)


@functools.cache
def _steps(name: str):
  """One compiled step per mode, run with the teacher = the student
  ('same') and with another init ('other'): {teacher: (prepare's batch,
  the params before the update, update metrics)}."""
  run = _run(**MODES[name])
  mesh = one_device_mesh()
  state, steps = fresh_train_state(run, mesh)
  params = jax.device_get(state.params)
  cfg = transformer_config(run.model)
  other = nnx.state(Transformer(cfg, rngs=nnx.Rngs(1)))
  out = {}
  with jax.set_mesh(mesh):
    dev = batch_lib.to_device(mesh, step_arrays(run, 2))
    for which, t_params in (('same', params), ('other', other)):
      teacher = Teacher(steps.graphdef, t_params)
      fresh = jax.tree.map(jnp.copy, state)  # the update donates it
      _, batch, _ = steps.prepare(
        fresh.params, None, fresh.kl_ctrl, None, dev, teacher=teacher
      )
      _, metrics = steps.update(fresh, batch)
      out[which] = (batch, params, jax.device_get(metrics))
  assert steps.traces == {'prepare': 1, 'update': 1}  # one compile each
  return run, steps.graphdef, out


@pytest.mark.parametrize('name', MODES)
def test_teacher_equals_student_zero_loss_and_gradient(name):
  """The teacher is the student: the term is 0 and (advantages zeroed, no
  task reward) so is the update's gradient; except k1's, whose pathwise
  gradient ∇Σ s is 0 only in expectation (losses/distill.py), and verl's
  forward top-k KL on a support short of the vocabulary, not renormalised:
  its gradient −Σ_k p_k ∇q_k pulls mass onto the support."""
  _, _, out = _steps(name)
  m = out['same'][2]
  assert abs(m[direct.LOSS_METRIC]) < 1e-6, name
  assert m['actor/pg_loss'] == 0.0, name
  if name in ('reverse_kl_k1', 'topk_forward'):
    assert m['actor/grad_norm'] > 1e-3, name
  else:
    assert m['actor/grad_norm'] < 1e-5, name


def _library_value(run, batch, params, graphdef):
  """The library loss of `run.distill.loss` on the whole mini-batch (the
  update's first step sees the params before it)."""
  cfg = run.distill
  mask = batch.response_mask
  model = nnx.merge(graphdef, params)
  if cfg.loss == 'reverse_kl':
    s = scoring.response_logp(run, graphdef, params, batch)
    return distill_loss.reverse_kl_loss(
      s, batch.teacher_logp, mask, estimator=cfg.estimator
    )[0]
  logp_all = direct.response_log_softmax(model, batch)
  s = distill_loss.topk_logp(logp_all, batch.teacher_topk_ids)
  t = batch.teacher_topk_logp
  if cfg.loss == 'topk_kl':
    return distill_loss.topk_kl(s, t, mask, direction=cfg.topk_direction)[0]
  if t.shape[-1] < model.config.vocab_size:
    s, t = distill_loss.with_rest(s), distill_loss.with_rest(t)
  return distill_loss.generalized_jsd(s, t, mask, beta=cfg.beta)[0]


@pytest.mark.parametrize('name', MODES)
def test_update_loss_is_the_library_loss(name):
  """Two micro-batches summed with the mini-batch's normaliser give the
  library's token mean over the whole mini-batch; the actor loss is the
  (zero-advantage) policy loss plus coef × the term."""
  run, graphdef, out = _steps(name)
  batch, params, m = out['other']
  want = _library_value(run, batch, params, graphdef)
  assert abs(float(want)) > 1e-3, name  # a real gap to the other init
  assert_close(m[direct.LOSS_METRIC], want, TOL_LAYOUT_METRICS, what=name)
  assert_close(
    m['actor/loss'], 0.5 * m[direct.LOSS_METRIC], TOL_LAYOUT_METRICS, what=name
  )


def test_prepare_carries_the_teacher_fields():
  """reverse_kl: the teacher's sampled-token log-probs; top-k: K ids and
  log-probs, sorted, K capped at the vocabulary; advantages zeroed (no
  task reward)."""
  batch = _steps('reverse_kl_k3')[2]['other'][0]
  assert batch.teacher_logp.shape == batch.response_mask.shape
  assert batch.teacher_topk_ids is None
  assert not np.any(np.asarray(batch.advantages))
  for name, k in (('gjsd_rest', 4), ('gjsd_full', 27)):
    batch = _steps(name)[2]['other'][0]
    vals = np.asarray(batch.teacher_topk_logp)
    assert batch.teacher_topk_ids.shape == (*batch.response_mask.shape, k)
    assert batch.teacher_logp is None
    assert np.all(np.diff(vals, axis=-1) <= 0) and np.all(vals <= 0)


def _config(preset='', **distill):
  config = pulse_config(preset)
  config.distill.teacher = '/no/such/teacher'
  for k, v in distill.items():
    config.distill[k] = v
  return config


@pytest.mark.parametrize(
  'preset,distill,extra,field',
  [
    ('bypass_pg_is', dict(loss='reverse_kl'), {}, r'config\.distill\.loss'),
    ('', dict(loss='gjsd'), {'train.packing': True}, r'config\.train\.packing'),
    (
      '',
      dict(loss='topk_kl'),
      {'rollout.logprob_mode': 'truncated'},
      r'config\.rollout\.logprob_mode',
    ),
    ('', dict(loss='gjsd', lmbda=0.5), {}, r'config\.distill\.lmbda'),
    (
      '',
      dict(loss='topk_kl', logp_source='engine', correct_teacher=False),
      {},
      r'config\.distill\.loss',
    ),
    ('', dict(loss='kl'), {}, r'config\.distill\.loss'),
  ],
)
def test_config_errors_name_the_field(preset, distill, extra, field):
  config = _config(preset, **distill)
  for path, value in extra.items():
    section, key = path.split('.')
    config[section][key] = value
  with pytest.raises(ValueError, match=field + '.*allowed'):
    build.build(config)
