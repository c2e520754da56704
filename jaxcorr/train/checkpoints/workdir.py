"""Claiming a workdir: one trainer at a time, the same run on resume.

A `--workdir` holds one run: its checkpoints, metrics.jsonl and the
`config.json` that `jaxcorr.export` rebuilds the model from. Three things
keep a second invocation on the same directory from damaging it:

* A lock. `claim` takes an exclusive `fcntl.flock` on `<workdir>/.lock`
  (the holder's pid and host written inside) before anything else touches
  the directory; a second trainer on the same workdir fails at once with
  `WorkdirBusy` naming the holder. The kernel drops the lock when the
  holder exits, even on SIGKILL, so a stale lock file never blocks a
  restart. Object stores (`gs://...`) have no locks: there the claim only
  warns.
* A fingerprint. When the workdir has checkpoints, the new config is
  compared with the saved `config.json` before anything is written; a
  changed field outside `RESUMABLE` (algorithm, preset, learning rate,
  model shape, seed, ...) is refused with a `ConfigChanged` error listing
  the fields, unless `allow_change=True` (`--allow_config_change`), which
  resumes under the new values. Every checkpoint holds the config too
  (jaxcorr/train/checkpoints/resume.py), and the restore checks it the
  same way, so a deleted `config.json` does not let a changed config
  through; a `config.json` cut short is a `ConfigUnreadable` error naming
  it.
* Ordering. `Claim.write_config` writes `config.json` (atomically: a
  temporary file renamed) and is called by the trainer only after the
  restore succeeded or a fresh start was set up, so a rejected re-run
  leaves the original run's `config.json`, and with it its export, intact.

The tools that write outside the trainer (`jaxcorr.export --out`,
`jaxcorr.evaluate --output_dir`) check their output directory with
`check_output_dir` before writing anything: never the run directory or a
directory inside any run (one holding config.json with `checkpoints/` or
metrics.jsonl), where their files would replace the run's records
(config.json, `eval_samples/step_<N>.jsonl`), except a folder the run
keeps for that tool (`<workdir>/evaluate`); and any other non-empty
directory only with `--force`.
"""

from __future__ import annotations

import json
import os
import socket
import weakref
from collections.abc import Mapping
from typing import Any

from absl import logging
from etils import epath

CONFIG_FILE = 'config.json'
LOCK_FILE = '.lock'
CHECKPOINT_DIR = 'checkpoints'

# Fields that may differ on resume: how long and how often, not what is
# trained (the run stays the same run).
RESUMABLE = frozenset(
  {
    'train.num_steps',
    'train.checkpoint_every',
    'train.keep_checkpoints',
    'train.eval_every',
    'train.eval_prompts',
    'train.eval_at_start',
    'train.compile_cache',
    'train.log_every',
    # train.tensorboard: replaced by train.loggers; kept so a workdir
    # saved before resumes.
    'train.tensorboard',
    'train.loggers',
    'train.project',
    'train.run_name',
    'train.wandb_entity',
    'train.mlflow_tracking_uri',
    'data.path',
    'data.eval_path',
    'reward.timeout_s',
    'reward.step_budget_s',
    'reward.isolation',
    'reward.max_failure_fraction',
    'rollout.max_concurrent_decodes',
    # What evaluation measures, not what is trained.
    'eval.sets',
    'eval.samples',
    'eval.preset',
    'eval.k',
    'eval.samples_jsonl',
  }
)


RENAMED = {
  'rollout.engine_quant': 'rollout.simulated_quant',
  'rollout.speculative_draft': 'speculative.draft',
  'rollout.speculative_k': 'speculative.k',
  'rollout.speculative_ngram': 'speculative.ngram',
  'rollout.speculative_draft_layers': 'speculative.draft_layers',
}
"""Fields renamed after runs were saved with them: old -> new dotted name.
A saved config is read under the new names (`read_config`,
`config_changes`), so such a run resumes, exports and evaluates as
before."""


def renamed(saved: dict[str, Any]) -> dict[str, Any]:
  """`saved` (a run config's JSON dict) with `RENAMED` fields moved to
  their new names, in place."""
  for old, new in RENAMED.items():
    (section, field), (to_section, to_field) = old.split('.'), new.split('.')
    values = saved.get(section)
    if isinstance(values, dict) and field in values:
      saved.setdefault(to_section, {})[to_field] = values.pop(field)
  return saved


class WorkdirBusy(RuntimeError):
  """Another live process holds the workdir's lock."""


class ConfigChanged(ValueError):
  """A resumed run's config differs from the saved one in a field that
  changes what is trained."""


class ConfigUnreadable(ValueError):
  """The workdir's config.json cannot be read (one line at start-up)."""


class WorkdirUnusable(OSError):
  """--workdir cannot be a run directory (a file, a path through a file,
  no permission); one line at start-up (`jaxcorr.main`)."""


def _flatten(tree: Any, prefix: str = '') -> dict[str, Any]:
  out = {}
  if isinstance(tree, Mapping):
    for k, v in tree.items():
      out.update(_flatten(v, f'{prefix}{k}.'))
  else:
    out[prefix[:-1]] = tree
  return out


def _defaults() -> dict[str, Any]:
  """Every section field's default, flattened, in JSON form."""
  import ml_collections

  from jaxcorr.config import convert
  from jaxcorr.train import build

  sections = {
    name: convert.section(cls).to_dict() for name, cls in build.SECTIONS.items()
  }
  return _flatten(json.loads(ml_collections.ConfigDict(sections).to_json()))


def config_changes(
  saved: Mapping[str, Any], new: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
  """`(field, saved value, new value)` for every field outside `RESUMABLE`
  that differs between two config dicts (JSON form); a field present in one
  only counts as changed, unless the saved run predates it and the new
  value is its default (what the older code did: a new field is a new
  feature, off by default)."""
  a, b = _flatten(renamed(json.loads(json.dumps(saved)))), _flatten(new)
  defaults = _defaults()
  missing = object()
  out = []
  for key in sorted(set(a) | set(b)):
    if key in RESUMABLE:
      continue
    va, vb = a.get(key, missing), b.get(key, missing)
    if va is missing and vb == defaults.get(key, missing):
      continue
    if va != vb:
      out.append(
        (
          key,
          '(absent)' if va is missing else va,
          '(absent)' if vb is missing else vb,
        )
      )
  return out


def read_config(workdir: str) -> dict[str, Any] | None:
  """The run's saved `config.json` as a dict; None when there is none.
  Raises `ConfigUnreadable` naming the file when it is not a JSON object
  (a write cut short by a full disk or a copy)."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.is_file():
    return None
  try:
    saved = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigUnreadable(
      f'{path} is not valid JSON ({e}): cut short? The checkpoints hold the '
      "run's config too: delete the file to resume from them, or use "
      'another --workdir'
    ) from None
  if not isinstance(saved, dict):
    raise ConfigUnreadable(f'{path} is not a JSON object')
  return renamed(saved)


def check_config(
  workdir: str,
  saved: Mapping[str, Any],
  new: Mapping[str, Any],
  *,
  allow_change: bool,
  source: str = CONFIG_FILE,
) -> None:
  """Raises `ConfigChanged` when `new` changes a field of the `saved` run
  config (JSON dicts) outside `RESUMABLE`; with `allow_change` logs the
  changes instead. `source` names where `saved` came from."""
  changes = config_changes(saved, new)
  if not changes:
    return
  listed = '; '.join(
    f'config.{k}: {a!r} in the run, {b!r} now' for k, a, b in changes
  )
  if not allow_change:
    raise ConfigChanged(
      f'{workdir} holds a run with another config ({listed}; from '
      f'{source}). Resuming would silently continue under the new values: '
      'use another --workdir, or pass --allow_config_change to resume '
      'with them'
    )
  logging.warning('resuming %s with a changed config: %s', workdir, listed)


def _normal(path: str) -> epath.Path:
  """An absolute, symlink-free local path; remote (gs://) ones as given."""
  if '://' in path:
    return epath.Path(path.rstrip('/'))
  return epath.Path(os.path.realpath(os.path.expanduser(path)))


def _is_run_dir(d: epath.Path) -> bool:
  """What a trainer leaves in its workdir: config.json with checkpoints or
  metrics."""
  return (d / CONFIG_FILE).is_file() and (
    (d / CHECKPOINT_DIR).is_dir() or (d / 'metrics.jsonl').is_file()
  )


def check_output_dir(
  workdir: str,
  out: str,
  *,
  flag: str,
  writes: str,
  force: bool = False,
  own: str | None = None,
) -> None:
  """ValueError (one line, naming `flag`) when writing into `out` could
  replace the records of the run in `workdir` or of any other run, or
  other files (module doc); returns when `out` is new, empty, `force`
  allows it, or it is `own` (a folder of this run kept for the tool, or
  inside it). `writes` says what would be replaced, e.g. "the export
  writes config.json there, replacing the run's own"."""
  run, target = _normal(workdir), _normal(out)
  mine = own is not None and (
    target == _normal(own) or _normal(own) in target.parents
  )
  for d in () if mine else (target, *target.parents):
    if d == run or _is_run_dir(d):
      what = 'the run directory' if d == run else 'a run directory'
      where = 'is' if d == target else 'is inside'
      raise ValueError(
        f'{flag}={out} {where} {what} {d}: {writes}; choose a directory '
        'outside any run (--force does not override this)'
      )
  if target.exists() and not target.is_dir():
    raise ValueError(f'{flag}={out} is a file, not a directory')
  if mine:
    return
  if target.is_dir() and any(True for _ in target.iterdir()) and not force:
    raise ValueError(
      f'{flag}={out} is a non-empty directory; choose a new or empty one, '
      'or pass --force to write into it (files of the same name are '
      'replaced)'
    )


def has_checkpoints(workdir: str) -> bool:
  """Whether `<workdir>/checkpoints` holds a committed step directory."""
  root = epath.Path(workdir) / CHECKPOINT_DIR
  if not root.is_dir():
    return False
  return any(p.name.isdigit() for p in root.iterdir())


class _Lock:
  """An exclusive, non-blocking `flock` on a local file (module doc)."""

  def __init__(self, path: str):
    import fcntl

    self.path = path
    self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(self._fd, 200, 0).decode(errors='replace').strip()
      os.close(self._fd)
      raise WorkdirBusy(
        f'{os.path.dirname(path)} is in use by another trainer '
        f'({holder or "unknown holder"}; lock {path}): wait for it to '
        'finish or use another --workdir'
      ) from None
    os.ftruncate(self._fd, 0)
    os.pwrite(
      self._fd, f'pid {os.getpid()} on {socket.gethostname()}\n'.encode(), 0
    )
    # Closing the descriptor drops the lock: on release(), or when the
    # owner is garbage-collected without one.
    self.release = weakref.finalize(self, os.close, self._fd)


class Claim:
  """A claimed workdir (`claim`); `release()` or process exit frees it."""

  def __init__(self, workdir: str, config_json: str, lock: _Lock | None):
    self.workdir = workdir
    self._config_json = config_json
    self._lock = lock

  def write_config(self) -> None:
    """Writes `<workdir>/config.json` (temporary file, then rename)."""
    path = epath.Path(self.workdir) / CONFIG_FILE
    tmp = path.parent / f'{CONFIG_FILE}.tmp'
    tmp.write_text(self._config_json)
    tmp.replace(path)

  def release(self) -> None:
    if self._lock is not None:
      self._lock.release()
      self._lock = None


def claim(workdir: str, config: Any, *, allow_change: bool = False) -> Claim:
  """Locks `workdir` and checks `config` (a ConfigDict) against the run
  saved there (module doc). Writes nothing but the lock file; raises
  `WorkdirUnusable`, `WorkdirBusy`, `ConfigUnreadable` or
  `ConfigChanged`."""
  config_json = config.to_json(indent=2)
  path = epath.Path(workdir)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    if path.exists():
      why = 'it is a file, not a directory'
    else:
      why = f'cannot create it ({e.strerror or e})'
    raise WorkdirUnusable(f'--workdir={workdir}: {why}') from None
  lock = None
  if '://' in workdir:
    logging.warning(
      '%s is an object store: no workdir lock; run one trainer at a time',
      workdir,
    )
  else:
    lock = _Lock(os.path.join(os.fspath(path), LOCK_FILE))
  try:
    # Without a committed step a fresh start may use any config.
    saved = read_config(workdir) if has_checkpoints(workdir) else None
    if saved is not None:
      check_config(
        workdir, saved, json.loads(config_json), allow_change=allow_change
      )
  except BaseException:
    if lock is not None:
      lock.release()
    raise
  return Claim(workdir, config_json, lock)
