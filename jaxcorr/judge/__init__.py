"""LLM judges (generative reward models) as reward functions
(docs/data_and_rewards.md, "LLM judge").

* `verdict`: the default rubric, `parse_verdict` ('Score: N' or yes/no by
  a configurable regex) and `UnparsedVerdict`;
* `judge`: `JudgeConfig`, `Judge` (batched grading on jaxcorr's engine,
  callable as a reward), `register_judge` and `bind_policy_judges` (the
  trainer hands its rollout engine to judges with model='policy').
"""

from jaxcorr.judge.judge import (
  POLICY,
  Judge,
  JudgeConfig,
  bind_policy_judges,
  register_judge,
)
from jaxcorr.judge.verdict import (
  DEFAULT_RUBRIC,
  DEFAULT_VERDICT,
  UnparsedVerdict,
  compile_verdict,
  parse_verdict,
)

__all__ = [
  'DEFAULT_RUBRIC',
  'DEFAULT_VERDICT',
  'POLICY',
  'Judge',
  'JudgeConfig',
  'UnparsedVerdict',
  'bind_policy_judges',
  'compile_verdict',
  'parse_verdict',
  'register_judge',
]
