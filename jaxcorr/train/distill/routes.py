"""Multi-teacher distillation (MOPD): which teacher scores which row.

    distill.teachers  'name=path,name=path'   the teachers, by name (the
                      `distill/<name>/` metrics); paths as distill.teacher
    distill.routes    'task:name,task:name'   each data task's teacher;
                      '' routes every task to the teacher of its own name

A task is a row's `Example.task` (jaxcorr/data/task_ids.py: add / sub /
mul for arithmetic, a reasoning-gym task name, else the data source's
name). `route_table` turns the routes into a tuple, task id -> teacher
index, fixed at start-up (a static argument of `prepare`): a task with no
teacher and a teacher with no task are one-line errors naming the field.
A single `distill.teacher` takes every task (no table to check).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from jaxcorr.config.fields import fail

TEACHERS_FIELD = 'config.distill.teachers'
ROUTES_FIELD = 'config.distill.routes'
_NAME = re.compile(r'[A-Za-z0-9_]+')  # a metric path segment


def _pairs(text: str, sep: str) -> list[tuple[str, str]]:
  out = []
  for item in text.split(','):
    key, found, value = item.partition(sep)
    out.append((key.strip(), value.strip()) if found else (item.strip(), ''))
  return out


def parse_teachers(text: str) -> tuple[tuple[str, str], ...]:
  """`'name=path,name=path'` -> ((name, path), ...); names are metric-safe
  (letters, digits, '_') and distinct, every path non-empty."""
  allowed = "'name=path,name=path' (name: letters, digits, _)"
  pairs = _pairs(text, '=')
  for name, path in pairs:
    if not _NAME.fullmatch(name) or not path:
      fail(TEACHERS_FIELD, text, allowed, f'bad entry {name}={path}')
  names = [n for n, _ in pairs]
  if len(set(names)) != len(names):
    fail(TEACHERS_FIELD, text, allowed, 'a teacher name appears twice')
  return tuple(pairs)


def parse_routes(
  text: str, names: Sequence[str]
) -> tuple[tuple[str, str], ...]:
  """`'task:name,...'` -> ((task, teacher name), ...); '' -> ()."""
  if not text.strip():
    return ()
  allowed = 'task:teacher pairs naming teachers of distill.teachers (' + (
    ', '.join(map(repr, names)) + ')'
  )
  pairs = _pairs(text, ':')
  for task, name in pairs:
    if not task or name not in names:
      fail(ROUTES_FIELD, text, allowed, f'bad entry {task}:{name}')
  tasks = [t for t, _ in pairs]
  if len(set(tasks)) != len(tasks):
    fail(ROUTES_FIELD, text, allowed, 'a task is routed twice')
  return tuple(pairs)


def route_table(
  tasks: Sequence[str],
  names: Sequence[str],
  routes: Sequence[tuple[str, str]],
) -> tuple[int, ...]:
  """Task id -> teacher index (module doc): each task's route, or with no
  routes the teacher of its name."""
  chosen = dict(routes) if routes else {t: t for t in tasks if t in names}
  shown = ', '.join(map(repr, tasks))
  missing = [t for t in tasks if t not in chosen]
  if missing:
    fail(
      ROUTES_FIELD, ','.join(f'{t}:{n}' for t, n in routes),
      f"a teacher for each task of config.data ({shown})",
      f'no teacher for task(s) {", ".join(map(repr, missing))}',
    )  # fmt: skip
  unknown = [t for t in chosen if t not in tasks]
  idle = [n for n in names if n not in [chosen[t] for t in tasks]]
  if unknown or idle:
    fail(
      ROUTES_FIELD, ','.join(f'{t}:{n}' for t, n in routes),
      f'routes from the tasks of config.data ({shown}) to every teacher',
      f'unknown task(s) {unknown}, teacher(s) with no task {idle}',
    )  # fmt: skip
  return tuple(names.index(chosen[t]) for t in tasks)
