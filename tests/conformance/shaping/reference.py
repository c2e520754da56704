"""numpy re-enactments of the reference code for overlong shaping and VCPO,
and the writer of their goldens (`tests/golden/overlong`, `tests/golden/
vcpo`, format `jaxcorr-golden/1`, docs/conformance.md).

The reference frameworks (torch GPU stacks) do not run here, so each
function below follows one reference function line by line, in the
reference's dtype and operation order; the tests check the stored vectors
against these functions (the data is what they say) and jaxcorr against
the data. Sources read (with `fetch`):

* verl `b178a3cd5` `verl/workers/reward_manager/dapo.py`
  (`DAPORewardManager.__call__`, the `overlong_buffer_cfg.enable` branch):
  `valid_response_length = attention_mask[prompt_length:].sum()`,
  `expected_len = max_resp_len − len`, `exceed_len = valid_response_length
  − expected_len`, `overlong_reward = min(−exceed_len / len ·
  penalty_factor, 0)`, `reward += overlong_reward`, logged `overlong =
  overlong_reward < 0`; the init asserts `max_resp_len >= len`. The length
  is a torch int64, so `−exceed_len / len` is float32 (torch's true
  division) and the product with the Python float stays float32.
* TRL `GRPOTrainer._generate_and_score_completions`
  (`mask_truncated_completions`): `is_truncated = ids[-1] not in (eos,
  pad)` per completion (older releases: `~is_eos.any(dim=1)`),
  `completion_mask *= ~is_truncated`; rewards and advantages are computed
  over every completion.
* VCPO (mit-han-lab/vcpo `c7f030f0`,
  `recipe/fully_async_policy/staleness_utils.py`): `compute_is_info`
  (`rollout_seq_is = exp(Σ (old − rollout)·mask)`), `compute_ess_info`
  (`ESS = (Σw)² / (Σw² + 1e-8)`, `ess_ratio = ESS / minibatch_size`),
  `megatron_actor._optimizer_step_with_buffer` (`lr_scale = min(1,
  ess_ratio / base_ess_ratio)`, `lr · lr_scale**0.5` for 'sqrt'),
  `compute_opob_baseline` + `get_weighted_mean` (`W_i = grad_norm² ·
  seq_is² [/ L²]`, `b = Σ W R / (Σ W + 1e-8)`, group scope) and
  `_update_grad_buffers` (`(R − b)/σ` with `norm_by_std` when σ > 1e-8,
  σ the population std of `compute_grad_info`).

Run `python -m tests.conformance.shaping.reference` to rewrite the
goldens (deterministic: fixed seeds).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2] / 'golden'
EOS, PAD = 2, 0
STOP, LENGTH = 0, 1  # jaxcorr FinishReason codes

# ----------------------------------------------------------------- verl DAPO


def verl_dapo_overlong(
  response_mask: np.ndarray,
  scores: np.ndarray,
  *,
  max_resp_len: int,
  buffer_len: int,
  penalty_factor: float,
) -> dict[str, np.ndarray]:
  """verl's DAPO reward manager, per row: (reward, overlong_reward,
  overlong) as it computes them (float32)."""
  assert max_resp_len >= buffer_len, (
    'max_resp_len must be larger than overlong_buffer.len'
  )
  reward, pen, flag = [], [], []
  for i in range(scores.shape[0]):
    valid_len = np.int64(response_mask[i].sum())
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_len - expected_len
    # torch: int64 tensor / int -> float32, * float -> float32
    ov = np.float32(-exceed_len) / np.float32(buffer_len)
    ov = np.float32(ov * np.float32(penalty_factor))
    ov = min(ov, np.float32(0.0))
    pen.append(ov)
    flag.append(ov < 0)
    reward.append(np.float32(scores[i]) + np.float32(ov))
  return {
    'reward': np.asarray(reward, np.float32),
    'overlong_reward': np.asarray(pen, np.float32),
    'overlong': np.asarray(flag, bool),
  }


# ---------------------------------------------------------------------- TRL


def trl_mask_truncated(
  completion_ids: list[list[int]], completion_mask: np.ndarray
) -> dict[str, np.ndarray]:
  """TRL's `mask_truncated_completions` (current form)."""
  is_truncated = np.array([ids[-1] not in (EOS, PAD) for ids in completion_ids])
  mask = completion_mask * (~is_truncated)[:, None].astype(np.int64)
  return {'is_truncated': is_truncated, 'completion_mask': mask}


# --------------------------------------------------------------------- VCPO


def vcpo_seq_is(old, rollout, mask) -> np.ndarray:
  """`rollout_seq_is` of `compute_is_info`, per row (float32, as torch)."""
  log_ratio = (old - rollout).astype(np.float32)
  return np.exp((log_ratio * mask.astype(np.float32)).sum(-1)).astype(
    np.float32
  )


def vcpo_ess(seq_is: np.ndarray, base: float, rule: str) -> dict:
  """`compute_ess_info` + the lr scale of `_optimizer_step_with_buffer`
  (Python floats, as the reference accumulates them)."""
  s = sum(float(w) for w in seq_is)
  s2 = sum(float(w) ** 2 for w in seq_is)
  ess = s**2 / (s2 + 1e-8)
  ratio = ess / len(seq_is)
  lr_scale = min(1.0, ratio / max(base, 1e-8))
  step = lr_scale**0.5 if rule == 'sqrt' else lr_scale
  return {'ess': ess, 'ess_ratio': ratio, 'step_scale': step}


def vcpo_opob(
  rewards,
  seq_is,
  grad_norm_sq,
  lengths,
  group_ids,
  *,
  use_is_weights: bool,
  normalize_by_length: bool,
  norm_by_std: bool,
) -> dict[str, np.ndarray]:
  """Per row: the group's `compute_opob_baseline` (scope 'group', agg
  'mean') and the advantage `_update_grad_buffers` applies to g_i."""
  base = np.zeros(len(rewards))
  adv = np.zeros(len(rewards))
  for g in np.unique(group_ids):
    rows = np.flatnonzero(group_ids == g)
    num = den = 0.0
    for i in rows:
      w = float(grad_norm_sq[i])  # grad_norm ** 2
      if use_is_weights:
        w *= float(seq_is[i]) ** 2
      if normalize_by_length:
        w = w / float(lengths[i]) ** 2
      num += float(rewards[i]) * w
      den += w
    b = num / (den + 1e-8)
    r = np.asarray(rewards[rows], np.float32)
    std = float(np.std(r))  # torch.std(unbiased=False)
    for i in rows:
      base[i] = b
      if norm_by_std and std > 1e-8:
        adv[i] = float(rewards[i]) / std - b / std
      else:
        adv[i] = float(rewards[i]) - b
  return {'baseline': base, 'advantage': adv}


# ------------------------------------------------------------------ inputs


def overlong_inputs(seed: int = 20261128) -> dict[str, np.ndarray]:
  """12 rows, T = 40 (= max_resp_len): lengths 0, 1, the ramp and the
  full budget; which rows end in EOS; multi-turn rows whose env tokens
  count in the length; finish reasons as jaxcorr records them."""
  rng = np.random.default_rng(seed)
  t = 40
  lengths = np.array([40, 33, 1, 27, 18, 40, 9, 24, 36, 13, 30, 39])
  context = np.arange(t)[None] < lengths[:, None]
  # rows 10 and 11 are multi-turn: environment tokens (context, no loss)
  agent = context.copy()
  agent[10, 5:12] = False
  agent[11, 20:31] = False
  ends_eos = np.array([0, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0], bool)
  # row 10: cut by max_turns after a turn that ended with EOS: jaxcorr
  # records LENGTH (a budget ended it), TRL's last-token test says complete.
  finish = np.where(ends_eos, STOP, LENGTH).astype(np.int8)
  finish[10] = LENGTH
  ids = rng.integers(3, 50, (12, t))
  ids[np.arange(12), lengths - 1] = np.where(ends_eos, EOS, ids[:, 0])
  ids = np.where(context, ids, PAD)
  scores = rng.choice([0.0, 1.0], 12).astype(np.float32)
  return {
    'context_mask': context,
    'agent_mask': agent,
    'completion_ids': ids.astype(np.int64),
    'lengths': lengths.astype(np.int64),
    'finish_reason': finish,
    'scores': scores,
  }


def vcpo_inputs(seed: int = 2602) -> dict[str, np.ndarray]:
  """12 rows in 3 groups of 4, T = 16; π_old and μ a few tenths apart per
  token; per-row squared score-gradient norms."""
  rng = np.random.default_rng(seed)
  b, t = 12, 16
  lengths = rng.integers(1, t + 1, b)
  mask = np.arange(t)[None] < lengths[:, None]
  old = -rng.uniform(0.05, 2.0, (b, t)).astype(np.float32)
  rollout = (old + rng.normal(0, 0.15, (b, t))).astype(np.float32)
  rollout = np.minimum(rollout, -1e-6).astype(np.float32)
  return {
    'mask': mask,
    'old_logp': np.where(mask, old, 0).astype(np.float32),
    'rollout_logp': np.where(mask, rollout, 0).astype(np.float32),
    'rewards': rng.choice([0.0, 0.5, 1.0], b).astype(np.float32),
    'grad_norm_sq': rng.uniform(0.5, 4.0, b).astype(np.float32),
    'lengths': lengths.astype(np.float32),
    'group_ids': np.repeat(np.arange(3), 4).astype(np.int32),
  }


# ----------------------------------------------------------------- writing

OVERLONG_GRID = ((40, 10, 1.0), (40, 40, 0.5), (40, 1, 1.0), (40, 16, 2.0))
OPOB_GRID = tuple(
  (iw, nl, ns)
  for iw in (True, False)
  for nl in (False, True)
  for ns in (False, True)
)


def overlong_cases(x: dict) -> tuple[list, dict]:
  arrays = {f'inputs/{k}': v for k, v in x.items()}
  cases = []
  for max_len, buf, f in OVERLONG_GRID:
    cid = f'dapo/max{max_len}_len{buf}_f{f:g}'
    out = verl_dapo_overlong(
      x['context_mask'],
      x['scores'],
      max_resp_len=max_len,
      buffer_len=buf,
      penalty_factor=f,
    )
    for k, v in out.items():
      arrays[f'{cid}/out/{k}'] = v
    cases.append(
      {
        'id': cid,
        'group': 'dapo',
        'dataset': 'main',
        'function': 'verl.workers.reward_manager.dapo.DAPORewardManager.__call__',
        'kwargs': {
          'max_resp_len': max_len,
          'overlong_buffer_len': buf,
          'overlong_penalty_factor': f,
        },
        'tensor_args': {
          'attention_mask_response': 'inputs/context_mask',
          'scores': 'inputs/scores',
        },
        'outputs': {k: {'npz': f'{cid}/out/{k}'} for k in out},
      }
    )
  cases.append(
    {
      'id': 'dapo/error_buffer_longer',
      'group': 'dapo',
      'dataset': 'main',
      'function': 'verl.workers.reward_manager.dapo.DAPORewardManager.__init__',
      'kwargs': {
        'max_resp_len': 40,
        'overlong_buffer_len': 41,
        'overlong_penalty_factor': 1.0,
      },
      'outputs': {},
      'error': {
        'type': 'AssertionError',
        'message': 'max_resp_len must be larger than overlong_buffer.len',
      },
    }
  )
  ids = [list(r[m]) for r, m in zip(x['completion_ids'], x['context_mask'])]
  out = trl_mask_truncated(ids, x['agent_mask'].astype(np.int64))
  for k, v in out.items():
    arrays[f'trl/mask/out/{k}'] = v
  cases.append(
    {
      'id': 'trl/mask',
      'group': 'trl',
      'dataset': 'main',
      'function': 'trl.GRPOTrainer (mask_truncated_completions=True)',
      'tensor_args': {
        'completion_ids': 'inputs/completion_ids',
        'completion_mask': 'inputs/agent_mask',
      },
      'outputs': {k: {'npz': f'trl/mask/out/{k}'} for k in out},
      'notes': [
        'row 10: multi-turn, cut by max_turns after an EOS-ended turn '
        '(TRL: complete; jaxcorr: truncated, finish LENGTH)'
      ],
    }
  )
  return cases, arrays


def vcpo_cases(x: dict) -> tuple[list, dict]:
  arrays = {f'inputs/{k}': v for k, v in x.items()}
  seq_is = vcpo_seq_is(x['old_logp'], x['rollout_logp'], x['mask'])
  arrays['ess/out/seq_is'] = seq_is
  cases = []
  for rule, base in (('sqrt', 1.0), ('linear', 1.0), ('sqrt', 0.5)):
    cid = f'ess/{rule}_base{base:g}'
    cases.append(
      {
        'id': cid,
        'group': 'ess',
        'dataset': 'main',
        'function': 'staleness_utils.compute_ess_info + '
        'megatron_actor._optimizer_step_with_buffer',
        'kwargs': {'scaling_rule': rule, 'base_ess_ratio': base},
        'tensor_args': {
          k: f'inputs/{k}' for k in ('old_logp', 'rollout_logp', 'mask')
        },
        'outputs': {
          'seq_is': {'npz': 'ess/out/seq_is'},
          'metrics': {'value': vcpo_ess(seq_is, base, rule)},
        },
      }
    )
  for iw, nl, ns in OPOB_GRID:
    cid = f'opob/is{int(iw)}_len{int(nl)}_std{int(ns)}'
    out = vcpo_opob(
      x['rewards'],
      seq_is,
      x['grad_norm_sq'],
      x['lengths'],
      x['group_ids'],
      use_is_weights=iw,
      normalize_by_length=nl,
      norm_by_std=ns,
    )
    for k, v in out.items():
      arrays[f'{cid}/out/{k}'] = v
    cases.append(
      {
        'id': cid,
        'group': 'opob',
        'dataset': 'main',
        'function': 'staleness_utils.compute_opob_baseline + '
        'megatron_actor._update_grad_buffers',
        'kwargs': {
          'use_is_weights': iw,
          'normalize_by_length': nl,
          'norm_by_std': ns,
          'scope': 'group',
          'agg_mode': 'mean',
        },
        'tensor_args': {
          k: f'inputs/{k}'
          for k in (
            'old_logp',
            'rollout_logp',
            'mask',
            'rewards',
            'grad_norm_sq',
            'lengths',
            'group_ids',
          )
        },
        'outputs': {k: {'npz': f'{cid}/out/{k}'} for k in out},
      }
    )
  return cases, arrays


META = {
  'overlong': {
    'verl': 'b178a3cd56f58b2d502255daba591e92833930a7',
    'trl': 'GRPOTrainer mask_truncated_completions (last-token form)',
  },
  'vcpo': {'vcpo': 'mit-han-lab/vcpo c7f030f0b77237cfb0e75e720669e2917a1bb56e'},
}


def write(name: str, cases: list, arrays: dict) -> None:
  folder = ROOT / name
  folder.mkdir(parents=True, exist_ok=True)
  index = {
    'format': 'jaxcorr-golden/1',
    'framework': name,
    'set': 'developer',
    'meta': {
      'generator': 'numpy re-enactment, tests/conformance/shaping/reference.py',
      **META[name],
    },
    'config_defaults': {},
    'n_cases': len(cases),
    'cases': cases,
  }
  tmp = folder / 'index.json.tmp'
  tmp.write_text(json.dumps(index, separators=(',', ':')))
  tmp.replace(folder / 'index.json')
  with open(folder / 'golden.npz.tmp', 'wb') as f:
    np.savez_compressed(f, **arrays)
  (folder / 'golden.npz.tmp').replace(folder / 'golden.npz')


if __name__ == '__main__':
  write('overlong', *overlong_cases(overlong_inputs()))
  write('vcpo', *vcpo_cases(vcpo_inputs()))
