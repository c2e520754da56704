"""Evaluation's parts beside the `Evaluator` (jaxcorr/train/evaluation.py):

* `config`: `EvalConfig`, the `eval` section (sets, samples per prompt, the
  sampling preset, the k's), and the sampling `PRESETS`;
* `sets`: the named eval sets' held-out prompts (`EvalSet`);
* `sampled`: pass@k, maj@k and sampled accuracy of one set's samples;
* `samples_log`: the JSONL of eval samples written per eval step.

docs/evaluation.md describes the harness.
"""
