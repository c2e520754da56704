"""SFT warm-up: cross-entropy on prompt -> answer rows before RL (with
agents: on an expert's multi-turn demonstrations, agent tokens only).

A policy from scratch never earns a reward, so GRPO's advantages are all
zero: `train.sft_steps` steps of supervised learning on the task's answers
(their own learning rate `optim.sft_learning_rate` and optimizer state)
give RL something to improve. The SFT prompt stream is its own
(`setup.build_prompts`), so the RL data order does not depend on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxcorr.agents.demonstrations import Demonstration
from jaxcorr.data.prompts import PromptLoader
from jaxcorr.data.tasks import Example
from jaxcorr.model import token_logprobs
from jaxcorr.train import batch as batch_lib
from jaxcorr.train.run_config import RunConfig
from jaxcorr.train.state import (
  apply_updates,
  copy_tree,
  init_optimizer,
  make_optimizer,
)
from jaxcorr.train.tracker import metrics

# Steps between two SFT progress lines.
_LOG_EVERY = 50


@flax.struct.dataclass
class SFTBatch:
  """prompt + answer + EOS rows, right-padded to S = P + T positions."""

  tokens: Any  # [B, S] int32
  segment_ids: Any  # [B, S] int32: 1 on real tokens
  loss_mask: Any  # [B, S - 1] bool: positions that predict answer tokens


def sft_batch(
  run: RunConfig,
  tokenizer: Any,
  encode: Callable[[Sequence[Example]], list[list[int]]],
  examples: Sequence[Example],
) -> SFTBatch:
  """The rows of `examples`: the encoded prompt, then the answer and EOS
  (cut at `rollout.max_new_tokens`), whose predictions the loss reads."""
  rows = []
  for ex, p in zip(examples, encode(examples)):
    a = [*tokenizer.encode(ex.answer, bos=False), tokenizer.eos_id]
    rows.append((p, a, [True] * len(a)))
  return _rows(run, rows)


def rows_of(
  run: RunConfig, tokenizer: Any, stage: Any
) -> Callable[[Sequence[Example]], SFTBatch]:
  """examples -> SFT rows for the trainer's `RolloutStage`: the task's
  answers (`sft_batch`), or with agents (`stage.agents`) the environment
  expert's demonstrations (`demonstration_batch`)."""
  if stage.agents is not None:
    return lambda ex: demonstration_batch(run, stage.agents.demonstrations(ex))
  return lambda ex: sft_batch(run, tokenizer, stage.encode, ex)


def demonstration_batch(
  run: RunConfig, demonstrations: Sequence[Demonstration]
) -> SFTBatch:
  """Multi-turn expert trajectories (jaxcorr/agents/demonstrations.py):
  the loss reads the agent's tokens only, as in RL; cut at
  `rollout.max_new_tokens` after the prompt."""
  return _rows(run, [(d.prompt, d.tokens, d.agent) for d in demonstrations])


def _rows(
  run: RunConfig,
  rows: Sequence[tuple[Sequence[int], Sequence[int], Sequence[bool]]],
) -> SFTBatch:
  """(prompt, response, trained) rows, the response cut at T, right-padded
  to S = P + T; `trained[j]` puts the prediction of response token j in
  the loss."""
  r = run.rollout
  s = r.max_prompt_length + r.max_new_tokens
  b = len(rows)
  tokens = np.zeros((b, s), np.int32)
  loss_mask = np.zeros((b, s - 1), bool)
  seg = np.zeros((b, s), np.int32)
  for i, (p, a, trained) in enumerate(rows):
    a, trained = list(a)[: r.max_new_tokens], list(trained)[: r.max_new_tokens]
    row = [*p, *a]
    tokens[i, : len(row)] = row
    loss_mask[i, len(p) - 1 : len(row) - 1] = trained
    seg[i, : len(row)] = 1
  return SFTBatch(tokens=tokens, segment_ids=seg, loss_mask=loss_mask)


class SFTStep:
  """The jitted cross-entropy step on an `SFTBatch`."""

  def __init__(
    self,
    graphdef: Any,
    tx: optax.GradientTransformation,
    *,
    chunk: int = 128,
    param_shardings: Any = None,
  ):
    self.graphdef = graphdef
    self.tx = tx
    self.chunk = chunk
    self.param_shardings = param_shardings
    # The trained params leave in `param_shardings` themselves, not in
    # XLA's spelling of them (P('fsdp',) for P('fsdp', 'tensor')): RL's
    # first `prepare` then lowers the program a restored run lowers, one
    # compile (and one compile-cache entry) for both.
    out = None if param_shardings is None else (param_shardings, None, None)
    self.step = jax.jit(self._step, donate_argnums=(0, 1), out_shardings=out)

  def loss(self, params: Any, batch: SFTBatch) -> tuple[jax.Array, dict]:
    model = nnx.merge(self.graphdef, params)
    logp = token_logprobs(
      model,
      batch.tokens,
      segment_ids=batch.segment_ids,
      chunk_size=self.chunk,
    )
    m = batch.loss_mask
    n = jnp.maximum(jnp.sum(m, dtype=jnp.float32), 1.0)
    nll = -jnp.sum(jnp.where(m, logp, 0.0)) / n
    # Sequence accuracy under teacher forcing would need the argmax of the
    # logits; the mean token probability is cheap.
    return nll, {
      'sft/loss': nll,
      'sft/token_prob': jnp.sum(jnp.where(m, jnp.exp(logp), 0.0)) / n,
    }

  def _step(self, params, opt_state, batch: SFTBatch):
    (_, metrics), grads = jax.value_and_grad(self.loss, has_aux=True)(
      params, batch
    )
    metrics['sft/grad_norm'] = optax.tree.norm(grads)
    params, opt_state = apply_updates(
      self.tx, grads, opt_state, params, self.param_shardings
    )
    return params, opt_state, metrics


def run_sft(
  run: RunConfig,
  graphdef: Any,
  params: Any,
  *,
  loader: PromptLoader,
  rows: Callable[[Sequence[Example]], SFTBatch],
  mesh: jax.sharding.Mesh,
  batch_shards: int,
  param_shardings: Any = None,
) -> Any:
  """`train.sft_steps` steps from `params` (not modified: the warm-up
  trains a copy); returns the trained params."""
  n = run.train.sft_steps
  tx, _ = make_optimizer(run.optim, run.optim.sft_learning_rate, n)
  sft = SFTStep(
    graphdef,
    tx,
    chunk=run.model.logprob_chunk,
    param_shardings=param_shardings,
  )
  params = copy_tree(params)
  opt_state = init_optimizer(tx, params, mesh)
  progress = metrics.ProgressLine(n, keys=('sft/loss', 'sft/token_prob'))
  t_prev = time.perf_counter()
  for i in range(n):
    batch = rows(loader.next_batch())
    size = batch_lib.padded_size(batch.tokens.shape[0], batch_shards)
    batch = batch_lib.pad_rows(batch, size)
    with jax.set_mesh(mesh):
      device = batch_lib.to_device(mesh, batch)
      params, opt_state, m = sft.step(params, opt_state, device)
    if (i + 1) % _LOG_EVERY == 0 or i + 1 == n:
      host = metrics.to_host_scalars(m)
      now = time.perf_counter()
      progress.update(i + 1, host, (now - t_prev) / _LOG_EVERY)
      t_prev = now
  return params
