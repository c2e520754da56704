"""The run's speculative draft (`config.speculative`, docs/speculative.md):
start-up checks against the other sections and, for draft='model', the
draft checkpoint resolved, checked and loaded like the distillation
teacher (jaxcorr/train/checkpoints/model_source.py).

Every refusal is one line naming the field, before any device work
(`jaxcorr.train.build` calls `check_for_run`).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxcorr.config.fields import fail
from jaxcorr.rollout.draft_model import DraftModel
from jaxcorr.train.checkpoints import model_source
from jaxcorr.train.policy import transformer_config

FIELD = 'config.speculative.draft_model'


def check_sections(run: Any) -> None:
  """What the engine cannot run speculation with, from the config alone:
  exact mode, replay kept sets, an MoE policy, too many draft layers."""
  spec, r = run.speculative, run.rollout
  if not spec.enabled:
    return
  on = f'config.speculative.draft={spec.draft!r}'
  if r.exact:
    fail(
      'config.rollout.exact', True, f'False with {on}',
      "the verify pass is a (k+1)-token forward, not exact mode's tiles",
    )  # fmt: skip
  if r.logprob_mode == 'replay':
    fail(
      'config.rollout.logprob_mode', 'replay', f"'full' or 'truncated' with {on}",
      'the speculative chunk records no kept sets',
    )  # fmt: skip
  if run.model.num_experts:
    fail(
      'config.speculative.draft', spec.draft, "'off' with an MoE policy",
      "the verify pass's routing is not recorded",
    )  # fmt: skip
  if spec.draft == 'layers' and not run.model.hf_path:
    layers = run.model.num_layers
    if spec.draft_layers >= layers:
      fail(
        'config.speculative.draft_layers', spec.draft_layers,
        f'an int in [1, model.num_layers={layers})',
      )  # fmt: skip


def check_for_run(run: Any) -> tuple[model_source.ModelSource, Any] | None:
  """`check_sections`, then for draft='model' the checks that read files:
  the path resolves, a workdir draft is not LoRA, its model config loads
  and it has the policy's tokenizer and vocabulary. Returns (source, the
  draft's TransformerConfig in rollout.engine_dtype), None without one."""
  check_sections(run)
  spec = run.speculative
  if spec.draft != 'model':
    return None
  src = model_source.resolve(spec.draft_model, FIELD)
  dtype = run.rollout.engine_dtype
  cfg = model_source.checked_config(src, dtype, FIELD, 'draft')
  policy_tok = model_source.tokenizer_identity(
    run.model.hf_path, run.data.tokenizer
  )
  model_source.check_same_tokens(
    src,
    cfg,
    transformer_config(run.model, backend='cpu'),  # vocab_size only
    policy_tok,
    FIELD,
    ('draft', 'policy'),
  )
  return src, cfg


def for_run(run: Any, mesh: jax.sharding.Mesh | None) -> DraftModel | None:
  """The run's draft model on the engine's `mesh` (None unless
  draft='model'). Loaded once: weight syncs do not refresh it."""
  found = check_for_run(run)
  if found is None:
    return None
  src, cfg = found
  graphdef, params = model_source.load_params(src, cfg, mesh)
  return DraftModel(graphdef, cfg, params)
