"""numpy re-enactments of verl's and NeMo-RL's dynamic sampling, and the
writer of their golden (`tests/golden/dynamic_sampling`, format
`jaxcorr-golden/1`, docs/conformance.md).

The frameworks (Ray + torch GPU stacks) do not run here, so each function
follows the reference code statement by statement, in its dtypes; the
tests check jaxcorr against the stored decisions. No golden of these
existed under /work/shared/golden/frontier. Sources read (with `search`):

* verl `recipe/dapo/dapo_ray_trainer.py` (`RayDAPOTrainer.fit`, the
  `filter_groups.enable` branch; the same code in
  `verl/trainer/ppo/ray_trainer.py` of later releases): per uid
  `np.std(metric_vals)`; `kept_prompt_uids = [uid ... if std > 0 or
  len(vals) == 1]`; the kept rows are concatenated over generation
  batches (`DataProto.concat`); `num_gen_batches += 1` per batch; while
  `num_prompt_in_batch < train_batch_size`: `if max_num_gen_batches <= 0
  or num_gen_batches < max_num_gen_batches: continue` else `raise
  ValueError`; once full, `batch = batch[:train_batch_size * n]`. The
  metric is `seq_reward` / `seq_final_reward` (a float32 tensor's
  `.sum(-1).numpy()`) or a `reward_extra_info` key (Python floats:
  float64).
* NeMo-RL `nemo_rl/algorithms/grpo.py` (`dynamic_sampling`) and
  `nemo_rl/algorithms/utils.py` (`calculate_baseline_and_std_per_prompt`):
  per row, over its prompt's rows (the row itself left out when
  `use_leave_one_out_baseline`), `baseline = Σ r / k`, `sq = Σ r² / k`,
  `std = sqrt(sq − baseline²).nan_to_num(0)` (float32); a prompt with <= 1
  valid row gets baseline = reward and std 0; rows with `std != 0` are
  kept (rows, not prompts) and appended to `batch_cache`; the batch
  counter is incremented before generation, and while the cache holds
  fewer than `num_prompts_per_step * n` rows it continues `if
  num_gen_batches <= dynamic_sampling_max_gen_batches` else raises
  ValueError; once full, `.slice(0, num_prompts_per_step * n)`.

Run `python -m tests.conformance.dynamic_sampling.reference` to rewrite
the golden (deterministic: the inputs are written out below).
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

FOLDER = pathlib.Path(__file__).resolve().parents[2] / 'golden/dynamic_sampling'
N = 3  # samples per prompt
PROMPTS = 4  # train batch (prompts)
NAN = math.nan

# Rounds (generation batches) of 4 groups of N rows; the comments say what
# each group exercises.
ROUNDS = [
  [
    [0, 0, 0],  # all wrong: dropped
    [1, 0, 1],  # kept
    [1, 1, 1],  # all right: dropped
    [0.1, 0.1, 0.1],  # equal, but np.std in float64 is 1.4e-17 > 0
  ],
  [
    [0, 1, 0],  # NeMo LOO: the row that differs sees std 0 -> dropped
    [0.5, 0.5, 0.5],
    [NAN, 1, 0],  # a NaN: np.std NaN, dropped
    [2, 3, 2],
  ],
  [
    [1, 1, 0],
    [0, 0, 0],
    [0.25, 0.75, 0.25],
    [1, 1, 1],
  ],
  [
    [0, 1, 1],
    [1, 0, 0],
    [0, 0, 1],
    [1, 1, 0],
  ],
]


def inputs() -> np.ndarray:
  """`[R, G * N]` metric values (float64), a group's rows adjacent."""
  return np.asarray(ROUNDS, np.float64).reshape(len(ROUNDS), -1)


# -------------------------------------------------------------------- verl


def verl_kept_rows(values: np.ndarray, dtype: str) -> np.ndarray:
  """One generation batch's kept rows (`[B]` bool), as verl decides."""
  uids = np.repeat(np.arange(len(values) // N), N)
  vals = values.astype(dtype)
  by_uid: dict[int, list] = {}
  for uid, v in zip(uids, vals):
    by_uid.setdefault(int(uid), []).append(v)
  std = {uid: np.std(v) for uid, v in by_uid.items()}
  kept = {uid for uid, s in std.items() if s > 0 or len(by_uid[uid]) == 1}
  return np.asarray([int(u) in kept for u in uids])


def verl_fill(values: np.ndarray, dtype: str, max_num_gen_batches: int):
  """(rows of the train batch as indices into `values.reshape(-1)`,
  generation batches used) or the ValueError verl raises."""
  rows: list[int] = []
  num_gen_batches = num_prompt_in_batch = 0
  b = values.shape[1]
  for r, batch in enumerate(values):
    num_gen_batches += 1
    kept = verl_kept_rows(batch, dtype)
    num_prompt_in_batch += int(kept.sum()) // N
    rows += [r * b + i for i in np.flatnonzero(kept)]
    if num_prompt_in_batch < PROMPTS:
      if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
        continue
      raise ValueError(f'{num_gen_batches=} >= {max_num_gen_batches=}.')
    return rows[: PROMPTS * N], num_gen_batches
  raise RuntimeError('the inputs ran out of rounds')


# ------------------------------------------------------------------- NeMo


def nemo_std(values: np.ndarray, loo: bool) -> np.ndarray:
  """`calculate_baseline_and_std_per_prompt`'s std (valid_mask all 1)."""
  r = values.astype(np.float32)
  baseline = np.zeros_like(r)
  sq = np.zeros_like(r)
  for p in range(len(r) // N):
    idx = np.arange(p * N, (p + 1) * N)
    m = (1 - np.eye(N) if loo else np.ones((N, N))).astype(np.float32)
    k = np.float32(N - int(loo))
    baseline[idx] = (m @ r[idx]) / k
    sq[idx] = (m @ (r[idx] ** 2)) / k
  with np.errstate(invalid='ignore'):
    std = np.sqrt(sq - baseline**2)
  return np.nan_to_num(std, nan=0.0)


def nemo_fill(values: np.ndarray, loo: bool, max_gen_batches: int):
  """(kept row indices, batches used) or NeMo-RL's ValueError."""
  cache: list[int] = []
  b = values.shape[1]
  for r, batch in enumerate(values):
    num_gen_batches = r + 1  # incremented before each generation
    cache += [r * b + i for i in np.flatnonzero(nemo_std(batch, loo) != 0)]
    if len(cache) < PROMPTS * N:
      if num_gen_batches <= max_gen_batches:
        continue
      raise ValueError('Dynamic sampling has reached the maximum allowed')
    return cache[: PROMPTS * N], num_gen_batches
  raise RuntimeError('the inputs ran out of rounds')


# ------------------------------------------------------------------ golden


def _case(cid: str, function: str, kwargs: dict) -> dict:
  return {
    'id': cid,
    'group': '_'.join(cid.split('/')[:2]),
    'function': function,
    'kwargs': {'n': N, **kwargs},
    'dataset': 'main',
    'tensor_args': {'values': 'inputs/values'},
  }


def _filter(cid: str, function: str, kwargs: dict, kept, arrays) -> dict:
  arrays[f'{cid}/out/kept'] = np.stack(kept)
  case = _case(cid, function, kwargs)
  case['outputs'] = {'kept': {'npz': f'{cid}/out/kept'}}
  return case


def _fill(cid: str, function: str, kwargs: dict, arrays, fn, *args) -> dict:
  case = _case(cid, function, {'prompts': PROMPTS, **kwargs})
  try:
    rows, used = fn(*args)
  except ValueError as e:
    case['error'] = {'type': 'ValueError', 'message': str(e)}
    return case
  arrays[f'{cid}/out/rows'] = np.asarray(rows, np.int32)
  case['outputs'] = {
    'rows': {'npz': f'{cid}/out/rows'},
    'rounds': {'value': used},
  }
  return case


def cases() -> tuple[list, dict]:
  x = inputs()
  arrays = {'inputs/values': x}
  out = []
  verl_fn = 'RayDAPOTrainer.fit: filter_groups'
  for dtype in ('float32', 'float64'):
    kept = [verl_kept_rows(v, dtype) for v in x]
    kw = {'dtype': dtype}
    out.append(_filter(f'verl/filter/{dtype}', verl_fn, kw, kept, arrays))
    for cap in (0, 2, 3):
      cid = f'verl/fill/{dtype}/max{cap}'
      args = (verl_fill, x, dtype, cap)
      out.append(_fill(cid, verl_fn, {**kw, 'cap': cap}, arrays, *args))
  nemo_fn = 'grpo.dynamic_sampling'
  for loo in (False, True):
    kept = [nemo_std(v, loo) != 0 for v in x]
    kw = {'leave_one_out': loo}
    cid = f'nemo/filter/loo{int(loo)}'
    out.append(_filter(cid, nemo_fn, kw, kept, arrays))
    for cap in (1, 2, 3):
      cid = f'nemo/fill/loo{int(loo)}/max{cap}'
      args = (nemo_fill, x, loo, cap)
      out.append(_fill(cid, nemo_fn, {**kw, 'cap': cap}, arrays, *args))
  return out, arrays


def write() -> None:
  case_list, arrays = cases()
  FOLDER.mkdir(parents=True, exist_ok=True)
  index = {
    'format': 'jaxcorr-golden/1',
    'framework': 'dynamic_sampling',
    'set': 'developer',
    'meta': {
      'generator': 'tests/conformance/dynamic_sampling/reference.py',
      'verl': 'recipe/dapo/dapo_ray_trainer.py (filter_groups)',
      'nemo_rl': 'nemo_rl/algorithms/grpo.py dynamic_sampling',
    },
    'config_defaults': {},
    'datasets': {
      'main': {
        'description': f'{len(ROUNDS)} rounds of 4 groups of {N} (reference.py)',
        'arrays': {'values': 'inputs/values'},
      }
    },
    'n_cases': len(case_list),
    'cases': case_list,
  }
  for name, write_to in (
    ('index.json', lambda f: f.write(json.dumps(index).encode())),
    ('golden.npz', lambda f: np.savez_compressed(f, **arrays)),
  ):
    tmp = FOLDER / f'{name}.tmp'
    with open(tmp, 'wb') as f:
      write_to(f)
    tmp.replace(FOLDER / name)


if __name__ == '__main__':
  write()
