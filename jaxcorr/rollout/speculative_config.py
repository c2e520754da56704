"""The `speculative` config section: speculative decoding's draft and its
sizes (jaxcorr/rollout/speculative.py, docs/speculative.md).

Its own rules (draft_model set exactly when draft='model') are checked
here; what needs another section or a file (rollout.exact, replay, an MoE
policy, the draft's tokenizer and vocabulary) is checked at start-up by
jaxcorr/train/rollouts/draft.py, and what needs the engine's model by
`SpeculativeConfig.check` when the engine is built.
"""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import (
  fail,
  integer,
  one_of,
  setting,
  text,
  validate,
)

DRAFTS = ('off', 'ngram', 'layers', 'model')
_POS = integer(1)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """Exact speculative decoding in the rollout engine (formerly the
  `rollout.speculative_*` fields)."""

  draft: str = setting(
    'off',
    one_of(*DRAFTS),
    "The draft (docs/speculative.md): 'off', 'ngram' (prompt lookup in "
    "the row's context), 'layers' (the policy's first draft_layers layers "
    "and its head) or 'model' (a smaller checkpoint, draft_model, with the "
    "policy's tokenizer); exact: the sampled distribution and μ are "
    'unchanged.',
  )
  k: int = setting(4, _POS, 'Draft tokens verified per round.')
  ngram: int = setting(2, _POS, "draft='ngram': the n-gram length matched.")
  draft_layers: int = setting(
    1, _POS, "draft='layers': the policy layers the draft runs (< num_layers)."
  )
  draft_model: str = setting(
    '',
    text,
    "draft='model': a Hugging Face directory, a jaxcorr workdir or "
    "'workdir@STEP' (as distill.teacher) with the policy's tokenizer and "
    'vocabulary, loaded in rollout.engine_dtype with its own KV cache. '
    'Fixed: weight syncs do not change it (its acceptance falls as the '
    'policy moves away from it).',
  )

  def __post_init__(self):
    p = validate(self)
    if (self.draft == 'model') != bool(self.draft_model):
      fail(
        f'{p}.draft_model',
        self.draft_model,
        "a path with draft='model', '' with any other draft",
      )

  @property
  def enabled(self) -> bool:
    return self.draft != 'off'

  def check(
    self, cfg, *, exact: bool, kept_capacity: int, moe: bool, draft_cfg=None
  ) -> None:
    """Errors for an engine (policy config `cfg`) this config cannot run
    on; `draft_cfg`: the draft model's config (draft='model')."""
    if not self.enabled:
      return
    p = 'config.speculative'
    if self.draft == 'layers' and not 1 <= self.draft_layers < cfg.num_layers:
      fail(
        f'{p}.draft_layers',
        self.draft_layers,
        f'an int in [1, num_layers={cfg.num_layers})',
      )
    if self.draft == 'model':
      if draft_cfg is None:
        fail(f'{p}.draft', 'model', 'a draft model given to the engine')
      check_draft_vocab(cfg, draft_cfg.vocab_size)
    for refused, field, why in (
      (exact, 'rollout.exact', "the verify pass is a (k+1)-token forward, "
       "not exact mode's one-token tiles"),
      (kept_capacity, "rollout.logprob_mode='replay'",
       'the speculative chunk records no kept sets'),
      (moe, 'an MoE policy', "the verify pass's routing is not recorded"),
    ):  # fmt: skip
      if refused:
        fail(f'{p}.draft', self.draft, f"'off' with {field}", why)


def check_draft_vocab(cfg, draft_vocab_size: int) -> None:
  """A draft model must share the policy's token ids (its vocabulary)."""
  if draft_vocab_size != cfg.vocab_size:
    fail(
      'config.speculative.draft_model',
      f'vocab_size={draft_vocab_size}',
      f"a draft with the policy's vocabulary ({cfg.vocab_size})",
    )
