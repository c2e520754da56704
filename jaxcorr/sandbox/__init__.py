"""Model-written code in a contained process (docs/data_and_rewards.md,
"Sandboxed code").

* `contain`: the launcher script (namespaces, new root, rlimits; run as a
  fresh `python -I -S`, never imported);
* `runner`: `run_python`, `Limits`, `Result`, `check_available`;
* `code_reward`: the `code_tests` reward (hidden tests, a per-run nonce)
  and `make_reward`;
* `tasks`: the generated code task (`config.data.source='code'`).

The agents' tool over the same runner is `jaxcorr.agents.code_tool`.
"""

from jaxcorr.sandbox.code_reward import (
  code_tests,
  extract_code,
  make_reward,
  run_tests,
)
from jaxcorr.sandbox.runner import Limits, Result, check_available, run_python

__all__ = [
  'Limits',
  'Result',
  'check_available',
  'code_tests',
  'extract_code',
  'make_reward',
  'run_python',
  'run_tests',
]
