"""Exact speculative sampling (jaxcorr/rollout/speculative.py) on a tiny
random model: the first two tokens' joint frequencies over many rows fit the
target's processed distribution (chi-square), greedy ids equal
non-speculative greedy, μ is the target's log-prob, bad configs fail. Each
for the 'ngram', 'layers' and 'model' drafts; the 'model' draft is a
checkpoint saved by a 0-step trainer run (a smaller pulse model with the
policy's vocabulary) loaded through the trainer's loader, its policy the
random model of the other drafts."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from jaxcorr import sampling
from jaxcorr.rollout import decode, draft_model, driver
from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.speculative import (
  SpeculativeLayout,
  ngram_draft,
  spec_chunk,
)
from jaxcorr.rollout.speculative_config import SpeculativeConfig
from jaxcorr.rollout.state import SamplingParams, pack_sampling
from jaxcorr.train.checkpoints import model_source
from jaxcorr.train.loop import Trainer
from tests.helpers.model_testing import VOCAB, random_model, tiny_config
from tests.helpers.trainer_config import pulse_config
from tests.rollout import test_engine as contract

CONTEXT = [
  5,
  6,
  7,
  5,
  6,
  7,
  5,
  6,
]  # x0 = 7 follows: the n-gram draft has a match
X0 = 7
TRUNCATED = SamplingParams(temperature=0.7, top_k=4, top_p=0.95)
# No truncation: only the frequencies can tell a wrong acceptance rule.
TEMPERATURE = SamplingParams(temperature=0.5)
ROWS = 4096


@pytest.fixture(scope='module')
def model():
  return random_model(tiny_config())


# The draft checkpoint: a 1-layer pulse model with the policy's vocabulary
# saved by a 0-step run as checkpoint 0.
DRAFT_MODEL = dict(
  num_layers=1, hidden_size=32, intermediate_size=64, vocab_size=VOCAB
)


@pytest.fixture(scope='module')
def draft(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('draft') / 'run'
  config = pulse_config(
    train__num_steps=0, train__sft_steps=0, train__eval_every=0
  )
  for name, value in DRAFT_MODEL.items():
    config.model[name] = value
  Trainer.from_config(config, str(workdir), config_name='test').train()
  src = model_source.resolve(str(workdir), 'config.speculative.draft_model')
  cfg = model_source.model_config(src, 'float32')
  graphdef, params = model_source.load_params(src, cfg, None)
  return draft_model.DraftModel(graphdef, cfg, params)


def _processed(model, tokens, sp):
  """The engine's sampling distribution after `tokens` (independent of
  speculative.py: softmax(z / τ) on `sampling.support`, renormalised)."""
  z = model(jnp.asarray([tokens]))[0, -1].astype(jnp.float32)
  keep = sampling.support(z, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
  w = np.where(keep, jax.nn.softmax(z / sp.temperature), 0.0)
  return w / w.sum()


@functools.cache
def _expected(model, sp, depth):
  """P(x1, .., x_depth) over the kept sequences after CONTEXT + [X0]."""
  out = {(): 1.0}
  for _ in range(depth):
    grown = {}
    for seq, prob in out.items():
      p = _processed(model, [*CONTEXT, X0, *seq], sp)
      for b in np.flatnonzero(p):
        grown[(*seq, int(b))] = prob * p[b]
    out = grown
  return out


def _continue(model, spec, sp, steps=2, draft=None):
  """ROWS independent continuations of CONTEXT + [X0], two tokens each,
  by the speculative chunk (spec, with `draft` for draft='model') or the
  plain one (None)."""
  cfg = model.config
  lay = SpeculativeLayout(
    config=cfg,
    slots=ROWS,
    max_prefill=16,
    max_target=32,
    chunk_steps=steps,
    min_attend_bucket=32,
    kept_capacity=0,
    mesh=None,
    speculative=spec or SpeculativeConfig(draft='ngram'),
    draft_config=None if draft is None else draft.config,
  )
  graphdef, params = nnx.split(model)
  state = lay.empty_state()
  ctx = jnp.tile(jnp.asarray(CONTEXT, jnp.int32), (ROWS, 1))
  live = jnp.ones((ROWS,), bool)
  state = decode.refill(graphdef, params, state, ctx, live)
  keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(
    jnp.arange(ROWS)
  )
  state = state.replace(
    cache=state.cache.replace(index=jnp.full((ROWS,), len(CONTEXT))),
    tokens=jnp.full((ROWS,), X0, jnp.int32),
    steps=jnp.ones((ROWS,), jnp.int32),
    keys=keys.astype(jnp.uint32),
    sampling=jnp.tile(pack_sampling(sp), (ROWS, 1)),
    limit=jnp.full((ROWS,), 100, jnp.int32),
    active=live,
    history=state.history.at[:, : len(CONTEXT)].set(ctx),
  )
  if draft is not None:  # the draft's cache of the context, as insert fills it
    prefix = types.SimpleNamespace(
      prompt=ctx[:1],
      source=jnp.zeros((ROWS,), jnp.int32),
      cache=types.SimpleNamespace(index=jnp.asarray([len(CONTEXT)])),
    )
    cache = draft_model.prefill(draft, state.draft, prefix, jnp.arange(ROWS))
    state = state.replace(draft=cache)
  stop = jnp.asarray([-1], jnp.int32)
  if spec is None:
    fn = jax.jit(
      decode.decode_chunk,
      static_argnums=(0,),
      static_argnames=('num_steps', 'attend_len'),
    )
    _, chunk = fn(
      graphdef, params, state, stop, 0, num_steps=steps, attend_len=32
    )
  else:
    _, chunk = spec_chunk(
      graphdef,
      params,
      state,
      stop,
      0,
      num_steps=steps,
      attend_len=32,
      spec=spec,
      cache_len=lay.cache_len,
      draft=draft,
    )
  assert np.all(np.asarray(chunk.counts) == steps)
  return chunk


def _chi2_pvalue(tokens, expected):
  cells = sorted(expected, key=expected.get, reverse=True)
  probs = np.array([expected[c] for c in cells], np.float64)
  index = {c: i for i, c in enumerate(cells)}
  counts = np.zeros(len(cells) + 1)
  for row in tokens:
    counts[index.get(tuple(int(x) for x in row), len(cells))] += 1
  assert counts[-1] == 0, 'a pair outside the kept sets was sampled'
  exp = probs * len(tokens)
  # Pool the cells expected < 5 times (the chi-square approximation).
  big = exp >= 5
  obs = np.append(counts[:-1][big], counts[:-1][~big].sum())
  exp = np.append(exp[big], exp[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  exp = exp.astype(np.float64)
  exp[-1] += obs.sum() - exp.sum()  # float32 rounding of the total
  return stats.chisquare(obs, exp).pvalue


NGRAM = SpeculativeConfig(draft='ngram', k=3)
LAYERS = SpeculativeConfig(draft='layers', k=3, draft_layers=1)


@pytest.mark.parametrize(
  'spec, sp, depth',
  [
    (None, TRUNCATED, 2),
    (NGRAM, TRUNCATED, 2),
    (LAYERS, TRUNCATED, 2),
    (NGRAM, TEMPERATURE, 1),
    (LAYERS, TEMPERATURE, 1),
  ],
  ids=['plain', 'ngram', 'layers', 'ngram-tau', 'layers-tau'],
)
def test_token_frequencies_fit_the_processed_target(model, spec, sp, depth):
  """Joint frequencies of the first `depth` tokens vs the target's
  processed distribution (chi-square over 4096 rows, fixed keys)."""
  chunk = _continue(model, spec, sp)
  tokens, lpt = np.asarray(chunk.tokens), np.asarray(chunk.logp_truncated)
  expected = _expected(model, sp, depth)
  assert _chi2_pvalue(tokens[:, :depth], expected) > 1e-3
  # μ: the target's processed (truncated) log-prob of each emitted token.
  p1 = _processed(model, [*CONTEXT, X0], sp)
  np.testing.assert_allclose(lpt[:, 0], np.log(p1[tokens[:, 0]]), atol=2e-5)


MODEL = SpeculativeConfig(draft='model', k=3, draft_model='checkpoint')


@pytest.mark.parametrize(
  'sp, depth', [(TRUNCATED, 2), (TEMPERATURE, 1)], ids=['trunc', 'tau']
)
def test_token_frequencies_fit_with_the_checkpoint_draft(
  model, draft, sp, depth
):
  """The chi-square and μ checks above with draft='model': q is the
  draft checkpoint's processed distribution on its own cache."""
  chunk = _continue(model, MODEL, sp, draft=draft)
  tokens, lpt = np.asarray(chunk.tokens), np.asarray(chunk.logp_truncated)
  assert _chi2_pvalue(tokens[:, :depth], _expected(model, sp, depth)) > 1e-3
  p1 = _processed(model, [*CONTEXT, X0], sp)
  np.testing.assert_allclose(lpt[:, 0], np.log(p1[tokens[:, 0]]), atol=2e-5)


PROMPTS = [[3, 4, 5], list(range(10, 31)), [7], [9] * 9, [5, 6, 5, 6, 5]]


def _engine(model, spec=None, draft=None):
  return PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=32,
    max_target_length=64,
    decode_chunk=8,
    speculative=spec,
    draft=draft,
  )


GREEDY = dict(max_new_tokens=20, top_k=1, stop_token_ids=(1, 2))


@pytest.fixture(scope='module')
def plain_greedy(model):
  return driver.generate(_engine(model), PROMPTS, **GREEDY)


@pytest.mark.parametrize('draft', ['ngram', 'layers'])
def test_greedy_ids_equal_plain_greedy(model, plain_greedy, draft):
  base = plain_greedy
  spec = SpeculativeConfig(draft=draft, k=3)
  got = driver.generate(_engine(model, spec), PROMPTS, **GREEDY)
  np.testing.assert_array_equal(got.response_tokens, base.response_tokens)
  np.testing.assert_array_equal(got.response_mask, base.response_mask)
  np.testing.assert_allclose(got.rollout_logp, base.rollout_logp, atol=1e-5)


def test_greedy_ids_equal_plain_greedy_with_the_checkpoint_draft(model, draft):
  """Also after a weight sync: the fixed draft now proposes for a policy
  that moved away from it; the ids stay the new policy's."""
  plain, spec = _engine(model), _engine(model, MODEL, draft)
  rng = np.random.default_rng(0)
  moved = jax.tree.map(
    lambda w: w + 0.3 * np.std(w) * rng.standard_normal(w.shape, np.float32),
    nnx.state(model),
  )
  ids = []
  for _ in range(2):
    base = driver.generate(plain, PROMPTS, **GREEDY)
    got = driver.generate(spec, PROMPTS, **GREEDY)
    np.testing.assert_array_equal(got.response_tokens, base.response_tokens)
    np.testing.assert_array_equal(got.response_mask, base.response_mask)
    np.testing.assert_allclose(got.rollout_logp, base.rollout_logp, atol=1e-5)
    ids.append(np.asarray(base.response_tokens))
    plain.update_params(moved)
    spec.update_params(moved)
  assert not np.array_equal(*ids)  # the sync moved the policy


@pytest.mark.parametrize(
  'spec, kw, match',
  [
    (dict(draft='ngram', k=0), {}, r'\.k: invalid value 0'),
    (dict(draft='bad'), {}, 'draft: invalid value'),
    (dict(draft='ngram'), dict(exact=True), 'rollout.exact'),
    (dict(draft='ngram'), dict(kept_set_capacity=8), 'logprob_mode'),
    (dict(draft='layers', draft_layers=2), {}, 'draft_layers: invalid value 2'),
    (dict(draft='model', draft_model='x'), {}, 'a draft model given'),
    (dict(draft='ngram', draft_model='x'), {}, 'draft_model: invalid'),
  ],
)
def test_bad_configs_fail_at_construction(model, spec, kw, match):
  with pytest.raises(ValueError, match=match):
    PolicyEngine(
      model,
      max_concurrent_decodes=2,
      max_prefill_length=8,
      max_target_length=16,
      speculative=SpeculativeConfig(**spec),
      **kw,
    )


def test_a_draft_with_another_vocabulary_fails_at_construction(model):
  other = draft_model.DraftModel.of(random_model(tiny_config(vocab_size=64)))
  with pytest.raises(ValueError, match=r"draft_model.*policy's vocabulary"):
    _engine(model, MODEL, other)


@pytest.fixture(scope='module', params=['ngram', 'layers', 'model'])
def spec_engine(request, model, draft):
  spec = SpeculativeConfig(
    draft=request.param,
    k=3,
    draft_model='checkpoint' if request.param == 'model' else '',
  )
  return PolicyEngine(
    model,
    max_concurrent_decodes=3,
    max_prefill_length=contract._PF,
    max_target_length=contract._TL,
    speculative=spec,
    draft=draft if request.param == 'model' else None,
  )


@pytest.mark.parametrize(
  'temperature, top_k, top_p', [(1.0, 0, 1.0), (0.6, 5, 0.9)]
)
def test_engine_contract_holds_with_speculation(
  spec_engine, model, temperature, top_k, top_p
):
  """tests/rollout/test_engine.py's contract test (validation, μ equal to
  the trainer's full and truncated log-probs, tokens inside the kept set)
  on a speculative engine."""
  contract.test_logprobs_match_the_trainer(
    spec_engine, model, temperature, top_k, top_p
  )


def test_ngram_draft_proposes_the_latest_continuation():
  """Row 0: context 5 6 7 5 6 | 7: the 2-gram (6, 7) last occurred ending
  at position 2, so the draft is 5 6 7 then (past the context) the last
  token. Row 1: no earlier (3, 9): the last token repeated."""
  hist = jnp.zeros((2, 12), jnp.int32)
  hist = hist.at[0, :5].set(jnp.asarray([5, 6, 7, 5, 6]))
  hist = hist.at[1, :3].set(jnp.asarray([1, 2, 3]))
  got = ngram_draft(hist, jnp.asarray([5, 3]), jnp.asarray([7, 9]), k=4, n=2)
  np.testing.assert_array_equal(got, [[5, 6, 7, 7], [9, 9, 9, 9]])


def test_a_draft_equal_to_the_target_is_always_accepted(model):
  """draft_layers = num_layers (the engine refuses it; the round does
  not): q = p, so each round emits all k drafts and the bonus, one verify
  forward for k + 1 tokens. A draft that proposed from a wrong cache or
  position would be rejected here (and only cost speed elsewhere)."""
  spec = SpeculativeConfig(draft='layers', k=3, draft_layers=2)
  chunk = _continue(model, spec, TRUNCATED, steps=4)
  assert int(chunk.steps) == 1


def test_the_policy_as_its_own_checkpoint_draft_is_always_accepted(model):
  """draft='model' with the policy's own weights through the engine
  (insert, chunks): q = p, so 19 greedy tokens after the first take 5
  rounds of up to k + 1 = 4 (chunks of 8: 4 + 4, 4 + 4, 3). Fails if
  insert leaves the draft's cache of the prompt empty, or if the draft
  does not write d_k's keys/values (the round after a full acceptance
  attends to an empty slot)."""
  engine = _engine(model, MODEL, draft_model.DraftModel.of(model))
  rounds = []
  inner = engine.batched.decode_chunk

  def counted(state, *a, **kw):
    state, chunk = inner(state, *a, **kw)
    rounds.append(int(chunk.steps))
    return state, chunk

  engine.batched.decode_chunk = counted
  prompts = [[3, 4, 5], [7] * 9, [5, 6, 5, 6, 5]]
  out = driver.generate(engine, prompts, max_new_tokens=20, top_k=1)
  assert np.asarray(out.response_mask).sum() == 3 * 20
  assert sum(rounds) == 5
