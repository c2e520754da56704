"""Advantages against prime-rl's goldens (`head/advantage`,
`legacy/advantage`). Skipped: prime-rl's length penalty, RAE and
hierarchical GRPO (outside the spec)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcorr.losses import rewards as rw
from tests.helpers import advantage_replay as ar
from tests.helpers import golden_data as gd
from tests.helpers.tolerance import assert_close

PRIME_SKIP = {
  'head/advantage/grpo_length_penalty': (
    "prime-rl's optional length penalty is out of scope "
    '(docs/math/advantages.md §4)'
  ),
  'head/advantage/rae': (
    "prime-rl's RAE baseline is stateful across calls (final_baselines); "
    'not an estimator of docs/math/advantages.md §4'
  ),
  'head/advantage/hierarchical_grpo': (
    "prime-rl's hierarchical (proposer/solver) GRPO is not an estimator of "
    'docs/math/advantages.md §4'
  ),
}


def _prime_batch(rewards, lengths):
  rewards = np.asarray(rewards, np.float32)
  lengths = np.asarray(lengths)
  t = int(lengths.max())
  mask = np.arange(t)[None, :] < lengths[:, None]
  return rewards, mask, rw.place_at_last_token(rewards, mask)


@pytest.mark.parametrize(
  'case',
  [
    *gd.case_params('prime', group='head/advantage'),
    *gd.case_params('prime', group='legacy/advantage'),
  ],
)
def test_prime_advantage(case):
  if case['id'] in PRIME_SKIP:
    pytest.skip(PRIME_SKIP[case['id']])
  gs = gd.load('prime')
  kw, out = gs.kwargs(case), gs.outputs(case)
  n = len(kw['rewards'])
  lengths = kw.get('num_output_tokens', kw.get('completion_lengths', [1] * n))
  _, mask, scores = _prime_batch(kw['rewards'], lengths)
  size = kw.get('samples_per_problem', 4)
  ids = (np.arange(n) // size * size).astype(np.int32)
  if 'groups' in kw:
    ids = np.zeros(n, np.int32)
    for g in kw['groups']:
      ids[g] = g[0]
  if 'max_rl' in case['id']:
    # prime-rl's max_rl divides by the group mean without an ε.
    a, _ = ar.run_estimator('maxrl', scores, mask, ids, eps=0.0)
  elif kw.get('length_weighted_mean'):
    a, _ = ar.run_estimator(
      'opo', scores, mask, ids
    )  # length-weighted baseline
  else:
    a, _ = ar.run_estimator('grpo', scores, mask, ids, norm_adv_by_std=False)
  per_row = a[np.arange(n), np.asarray(rw.last_token_index(mask))]
  key = 'advantages' if 'advantages' in out else 'advantage_per_trace'
  assert_close(per_row, out[key], what=key)
  if 'token_advantages' in out:
    assert_close(a[mask], out['token_advantages'], what='token_advantages')
