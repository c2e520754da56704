"""jaxcorr.plan.collectives: collective bytes read from compiled HLO, each
instruction counted as often as its loops run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcorr.plan.collectives import collective_bytes, shape_bytes


def _mesh():
  return jax.make_mesh((4,), ('x',), devices=jax.devices()[:4])


def _sharded(mesh, shape):
  return jax.ShapeDtypeStruct(
    shape, jnp.float32, sharding=NamedSharding(mesh, P('x', None))
  )


def _gather_sum(w, x, c):
  """x @ w with w sharded by rows: XLA all-gathers w (its input depends on
  the loop carry, so it stays in the loop), then all-reduces the sum."""
  return c + (x @ (w * c)).sum()


def test_scan_counts_each_trip():
  mesh = _mesh()
  w, x = _sharded(mesh, (64, 32)), _sharded(mesh, (8, 64))

  def f(w, x):
    def body(c, _):
      return _gather_sum(w, x, c), None

    return jax.lax.scan(body, 1.0, None, length=3)[0]

  hlo = jax.jit(f).lower(w, x).compile().as_text()
  t = collective_bytes(hlo)
  gather = t.kinds['all-gather']
  assert gather.count == 3
  assert gather.operand_bytes == 3 * 16 * 32 * 4  # the shard it sends
  assert gather.result_bytes == 3 * 64 * 32 * 4  # the whole weight back
  assert t.kinds['all-reduce'].count == 3
  assert t.kinds['all-reduce'].operand_bytes == 3 * 4
  assert t.unknown_loops == 0


def test_nested_loops_multiply_and_unknown_loops_use_the_bound():
  mesh = _mesh()
  w, x = _sharded(mesh, (64, 32)), _sharded(mesh, (8, 64))

  def nested(w, x):
    def outer(c, _):
      inner = lambda c, _: (_gather_sum(w, x, c), None)  # noqa: E731
      return jax.lax.scan(inner, c, None, length=3)[0], None

    return jax.lax.scan(outer, 1.0, None, length=2)[0]

  t = collective_bytes(jax.jit(nested).lower(w, x).compile().as_text())
  assert t.kinds['all-gather'].count == 6

  def early_exit(w, x):
    def cond(carry):
      return carry[0] < 5.0

    def body(carry):
      return _gather_sum(w, x, carry[0]), carry[1] + 1

    return jax.lax.while_loop(cond, body, (1.0, 0))[0]

  hlo = jax.jit(early_exit).lower(w, x).compile().as_text()
  once, bounded = collective_bytes(hlo), collective_bytes(hlo, loop_bound=7)
  assert once.unknown_loops == bounded.unknown_loops == 1
  assert once.kinds['all-gather'].count == 1
  assert bounded.kinds['all-gather'].count == 7


_ASYNC = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: bf16[4,8]) -> bf16[16,8] {
  %p = bf16[4,8]{1,0} parameter(0), sharding={devices=[4,1]<=[4]}
  %ags = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%p), dimensions={0}
  %agd = bf16[16,8]{1,0} all-gather-done(%ags)
  %ar = (f32[2]{0}, /*index=1*/s32[3]{0}) all-reduce(%agd, %p), to_apply=%add
  ROOT %r = bf16[16,8]{1,0} copy(%agd)
}
"""


def test_async_pairs_count_once_and_tuples_sum():
  t = collective_bytes(_ASYNC)
  gather = t.kinds['all-gather']
  assert (gather.count, gather.operand_bytes) == (1, 4 * 8 * 2)
  assert gather.result_bytes == 16 * 8 * 2
  reduce = t.kinds['all-reduce']
  assert reduce.count == 1
  assert reduce.operand_bytes == 16 * 8 * 2 + 4 * 8 * 2
  assert reduce.result_bytes == 2 * 4 + 3 * 4
  assert shape_bytes('(pred[3]{0}, f64[2,2]{1,0})') == 3 + 32
