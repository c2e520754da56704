"""Reward functions registered by name, and the weighted, fail-safe scorer.

A reward function maps `(response, answer) -> float`: the decoded response
text and the example's reference answer. `config.reward.functions` names
them with weights, `'math_answer:1.0,format:0.1'`, and `RewardScorer` sums
them per row. User code adds its own with `@register('name')` in any module
the config file imports.

* `config`: `RewardConfig`, the trainer's `reward` section;
* `registry`: `REWARDS`, `register`, the built-in rewards, `parse_spec`;
* `answers`: final-answer extraction and numeric comparison;
* `workers`: daemon threads whose stuck calls are abandoned and replaced;
* `processes`: worker processes killed and replaced on timeout
  (`config.reward.isolation='process'`);
* `verifiers`: `math_verify` and `reasoning_gym`, rewards that call
  third-party verifiers (optional extras), and `check_installed`;
* `code`: `code_tests`, model-written code against hidden tests in the
  sandbox (`jaxcorr.sandbox`), and `make_code_reward`;
* `scorer`: `RewardScorer` (isolation, timeouts, per-step budget, float32
  checks, failure metrics, a stop for a function that always fails),
  `check_spec` (the start-up check of a spec) and
  `check_rewards`.
"""

from jaxcorr.rewards.answers import (
  answers_match,
  extract_answer,
  last_boxed,
  to_number,
)
from jaxcorr.rewards.code import code_tests, make_code_reward
from jaxcorr.rewards.config import RewardConfig
from jaxcorr.rewards.registry import (
  REWARDS,
  Outcome,
  RewardFn,
  exact_match,
  format_reward,
  math_answer,
  parse_spec,
  register,
)
from jaxcorr.rewards.scorer import (
  MAX_STUCK,
  RewardFunctionFailing,
  RewardScorer,
  check_rewards,
  check_spec,
)
from jaxcorr.rewards.verifiers import (
  check_installed,
  math_verify_reward,
  reasoning_gym_reward,
)

__all__ = [
  'MAX_STUCK',
  'REWARDS',
  'Outcome',
  'RewardConfig',
  'RewardFn',
  'RewardFunctionFailing',
  'RewardScorer',
  'answers_match',
  'check_installed',
  'check_rewards',
  'check_spec',
  'code_tests',
  'exact_match',
  'extract_answer',
  'format_reward',
  'last_boxed',
  'make_code_reward',
  'math_answer',
  'math_verify_reward',
  'parse_spec',
  'reasoning_gym_reward',
  'register',
  'to_number',
]
