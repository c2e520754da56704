"""Model-written code in a contained process (docs/data_and_rewards.md,
"Sandboxed code").

* `contain`: the launcher script (namespaces, new root, rlimits; run as a
  fresh `python -I -S`, never imported);
* `runner`: `run_python`, `Limits`, `Result`, the run statuses and
  `check_available`.

The reward over it is `code_tests` (jaxcorr/rewards/code.py), the agents'
tool `jaxcorr.agents.code_tool`, the task `data.source='code'`
(jaxcorr/data/code_tasks.py).
"""

from jaxcorr.sandbox.runner import Limits, Result, check_available, run_python

__all__ = ['Limits', 'Result', 'check_available', 'run_python']
