"""The fused attention implementations (`model.attention`) against the jnp
reference (`layers.attend`): every mask kind, values and gradients, fp32 and
bf16; the model's training forward and cached prefill; start-up refusals.

Tolerances: fp32 1e-5 (the sums run in another order: blocks, an online
softmax), bf16 3e-2 (the probabilities and outputs are rounded to 8 bits at
other points).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxcorr import sharding as sh
from jaxcorr.model import Transformer, TransformerConfig
from jaxcorr.model import attention as fused
from jaxcorr.model.layers import attend
from jaxcorr.train import build
from jaxcorr.train.policy import ModelConfig, check_attention
from tests.helpers.trainer_config import pulse_config

FUSED = ('xla', 'splash_interpret')
TOL = {'float32': 1e-5, 'bfloat16': 3e-2}
B, S, DH = 2, 40, 16  # S not a multiple of splash's 128: the padding runs


def _segments(kind: str) -> np.ndarray | None:
  """[B, S] ids: 'causal' none, 'packed' three sequences then padding,
  'left_padded' the trainer's prompt padding (id 0) before the row."""
  if kind == 'causal':
    return None
  if kind == 'packed':
    row = [1] * 15 + [2] * 9 + [3] * 12 + [0] * 4
    return np.array([row, row[::-1]], np.int32)
  return np.array([[0] * 7 + [1] * 33, [0] * 19 + [1] * 21], np.int32)


def _qkv(heads, kv_heads, dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, S, heads, DH), dtype)
  k = jax.random.normal(keys[1], (B, S, kv_heads, DH), dtype)
  v = jax.random.normal(keys[2], (B, S, kv_heads, DH), dtype)
  return q, k, v, jax.random.normal(keys[3], (B, S, heads, DH), dtype)


def _close(got, want, dtype):
  got, want = (np.asarray(x, np.float32) for x in (got, want))
  np.testing.assert_allclose(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize('impl', FUSED)
@pytest.mark.parametrize(
  'kind,heads,kv_heads',
  [('causal', 4, 2), ('packed', 4, 2), ('left_padded', 4, 2), ('packed', 4, 4)],
)
def test_self_attention_matches_reference_with_gradients(
  impl, kind, heads, kv_heads
):
  dtype = 'float32'
  q, k, v, ct = _qkv(heads, kv_heads, dtype)
  seg = _segments(kind)
  mask = fused.CausalSegments(None if seg is None else jnp.asarray(seg), S)

  def value_and_grads(fn):
    def f(q, k, v):
      out, pull = jax.vjp(fn, q, k, v)
      return out, pull(ct)

    return jax.jit(f)(q, k, v)

  want = value_and_grads(lambda q, k, v: attend(q, k, v, mask.dense()))
  got = value_and_grads(
    lambda q, k, v: fused.self_attention(impl, q, k, v, mask.segment_ids)
  )
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _close(g, w, dtype)


@pytest.mark.parametrize('impl', FUSED)
def test_bf16_matches_reference(impl):
  q, k, v, _ = _qkv(4, 2, 'bfloat16')
  seg = jnp.asarray(_segments('packed'))
  want = jax.jit(attend)(q, k, v, fused.CausalSegments(seg, S).dense())
  got = jax.jit(fused.self_attention, static_argnums=0)(impl, q, k, v, seg)
  _close(got, want, 'bfloat16')


def _model(attention: str, dtype='float32') -> Transformer:
  cfg = TransformerConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    attention=attention,
    dtype=dtype,
  )
  return Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
  'mesh_config', [dict(data=2, fsdp=4), dict(data=2, tensor=4)]
)
def test_splash_on_a_mesh_runs_per_batch_shard(mesh_config):
  """Under a mesh splitting the batch the kernel runs in a shard_map over
  the batch axes (a tensor axis on heads stays automatic): same values."""
  q, k, v, _ = _qkv(4, 2, 'float32')
  seg = jnp.asarray(_segments('packed'))
  want = jax.jit(attend)(q, k, v, fused.CausalSegments(seg, S).dense())
  mesh = sh.make_mesh(mesh_config)
  run = jax.jit(fused.self_attention, static_argnums=0)
  with jax.set_mesh(mesh):
    got = run('splash_interpret', q, k, v, seg)
    hlo = run.lower('splash_interpret', q, k, v, seg).as_text()
  assert 'manual_computation' in hlo  # the kernel inside a shard_map
  _close(got, want, 'float32')


def _jit(model, fn):
  """`fn(model, *args)` jitted over the model's state."""
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda state, *a: fn(nnx.merge(graphdef, state), *a))
  return lambda *a: run(state, *a)


@pytest.mark.parametrize('impl', FUSED)
def test_training_forward_and_gradients_match(impl):
  """The transformer's packed forward (a `CausalSegments` mask down to the
  kernel) and its parameter gradients, fused against jnp."""
  tokens = jax.random.randint(jax.random.key(1), (B, S), 0, 64)
  seg = jnp.asarray(_segments('packed'))
  ref, model = _model('jnp'), _model(impl)

  def loss(m):
    h, _ = m.hidden_states(tokens, segment_ids=seg)
    return jnp.sum(h * h)

  def value_and_grad(model):
    graphdef, params = nnx.split(model)
    f = lambda p: loss(nnx.merge(graphdef, p))  # noqa: E731
    return jax.jit(jax.value_and_grad(f))(params)

  want_h, want_g = value_and_grad(ref)
  got_h, got_g = value_and_grad(model)
  np.testing.assert_allclose(got_h, want_h, rtol=1e-5)
  # Relative to each leaf's largest gradient: the jnp and xla fp32 runs
  # both sit ~8e-5 from a float64 run here (the final RMSNorm of the
  # near-zero activations of a random init amplifies rounding).
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(g, w, atol=2e-4 * float(np.abs(w).max()))


@pytest.mark.parametrize('impl', FUSED)
def test_cached_prefill_matches(impl):
  """Prefill over the KV cache (a dense mask of the cache's slots) with
  left-padded prompts: per-row write index and positions, as the engine
  places rows; then one decode step (jnp in every mode)."""
  pad = np.array([3, 0])
  length = 12
  tokens = jax.random.randint(jax.random.key(2), (B, length), 0, 64)
  positions = jnp.asarray(np.maximum(np.arange(length)[None] - pad[:, None], 0))
  seg = jnp.asarray(np.arange(length)[None] >= pad[:, None]).astype(jnp.int32)

  def run(model):
    cache = model.init_cache(B, 16)
    h, cache = model.hidden_states(
      tokens, positions=positions, segment_ids=seg, cache=cache
    )
    step, _ = model.hidden_states(
      tokens[:, :1], positions=positions[:, -1:] + 1, cache=cache
    )
    return h, step, cache.k[1].swapaxes(1, 2)  # [B, T, K, Dh]

  (h, step, k), (want_h, want_step, want_k) = (
    _jit(_model(a), run)() for a in (impl, 'jnp')
  )
  real = np.asarray(seg, bool)  # a padding slot's output is never read
  np.testing.assert_allclose(h[real], want_h[real], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(
    k[:, :length][real], want_k[:, :length][real], atol=1e-5, rtol=1e-5
  )
  np.testing.assert_allclose(step, want_step, atol=1e-5, rtol=1e-5)


def test_unknown_attention_is_refused():
  with pytest.raises(ValueError, match=r"attention='flash'.*expected one of"):
    _model('flash')
  with pytest.raises(ValueError, match=r'config\.model\.attention|attention'):
    ModelConfig(attention='flash')


@pytest.mark.parametrize(
  'attention,backend,dtype,why',
  [
    ('cudnn', 'cpu', 'bfloat16', "'cudnn' runs on gpu only"),
    ('splash', 'cpu', 'float32', "'splash' runs on tpu only"),
    ('cudnn', 'gpu', 'float32', 'no float32 kernel'),
  ],
)
def test_backend_refusal_names_field_and_allowed(
  attention, backend, dtype, why
):
  model = ModelConfig(attention=attention, dtype=dtype)
  with pytest.raises(ValueError) as e:
    check_attention(model, dtype, backend)
  msg = str(e.value)
  assert msg.startswith(f"config.model.attention: invalid value '{attention}'")
  assert why in msg and 'allowed:' in msg and "'jnp'" in msg


def test_backend_accepts_what_it_runs():
  for name in ('jnp', 'xla', 'splash_interpret', 'auto'):
    check_attention(ModelConfig(attention=name), 'float32', 'cpu')
  check_attention(ModelConfig(attention='auto'), 'float32', 'gpu')  # xla
  assert fused.resolve('auto', 'cpu', jnp.float32) == 'jnp'
  assert fused.resolve('auto', 'gpu', jnp.bfloat16) == 'cudnn'
  assert fused.resolve('auto', 'tpu', jnp.float32) == 'splash'


def test_start_up_check_reads_the_run_config():
  """`build.check_backend` (jaxcorr.main calls it after jax.distributed)
  refuses what this CPU backend cannot run, naming the field."""
  run = build.build(pulse_config(model__attention='cudnn'))
  with pytest.raises(ValueError, match=r"^config\.model\.attention: .*'jnp'"):
    build.check_backend(run)
  build.check_backend(build.build(pulse_config(model__attention='xla')))


def test_fused_under_context_parallelism_matches_unsplit():
  """`mesh.sequence` = 4: a fused value goes through the gathered K/V path
  (each device's dense mask block) and gives the unsplit jnp forward."""
  tokens = jax.random.randint(jax.random.key(3), (B, S), 0, 64)
  seg = jnp.asarray(_segments('packed'))

  def run(model):
    return model.hidden_states(tokens, segment_ids=seg)[0]

  want = _jit(_model('jnp'), run)()
  with jax.set_mesh(sh.make_mesh(dict(fsdp=2, sequence=4))):
    got = _jit(_model('xla'), run)()
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
