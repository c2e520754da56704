"""One process of a CPU trainer job, for tests/train/test_multihost.py.

    python tests/helpers/multihost_driver.py --devices=4 --processes=2 \\
      --process_id=0 --port=12345 --workdir=/tmp/two --out=/tmp/two.npz \\
      --preset=decoupled_token_is --num_steps=2

Trains the pulse config (`configs/arith_tiny.py:pulse+<preset>` with a
test reward, no evaluation, no TensorBoard) with `--devices` fake CPU
devices in this process, as process `--process_id` of `--processes` (gloo
collectives through `jaxcorr.distributed`). `--workdir` may be repeated: the
workdirs are trained in turn, each by a fresh `Trainer`, and one holding a
checkpoint resumes from it, whatever process count wrote it.

Afterwards process 0 writes `--out`, an .npz of parameters gathered to the
host, for each workdir `<name>` (its basename): `<name>/final/<path>` (the
trainer's parameters at the end) and `<name>/step<s>/<path>` for every
checkpoint in the workdir, restored by this job (its process count and
device layout).

`--set section.field=value` (repeatable) overrides the config (the value a
Python literal, else a string), e.g. `--set rollout.mode=async`;
`--set <name>:section.field=value` only that of workdir `<name>`. With
`--rollouts`, every process also writes `<rollouts>/p<process_id>.npz`: for
each workdir and RL step, the rows this process trained on,
`<name>/step<s>/<field>` (`ROLLOUT_FIELDS` of its `RolloutBatch`, and
`rewards`), as they left its rollout source. `--preempt <name>:<step>`
sends this process SIGTERM once workdir `<name>` has trained step `<step>`:
the trainer's preemption path (checkpoint, stop) with the rollouts of the
next steps in flight. `--kill <name>:<step>` sends it SIGKILL once that
step's metrics line is written: a crash, nothing saved since the last
periodic checkpoint (the job ends there, without its .npz files).

The device count must be set before anything starts the JAX backend, hence a
script of its own rather than code in the pytest process.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import jax

REPO = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
REWARD = 'test_scattered'
ROLLOUT_FIELDS = (
  'prompt_tokens',
  'response_tokens',
  'response_mask',
  'rollout_logp',
  'policy_version',
  'group_id',
  'sample_id',
)


def parse_args(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--devices', type=int, required=True)
  p.add_argument('--processes', type=int, default=1)
  p.add_argument('--process_id', type=int, default=0)
  p.add_argument('--port', type=int, default=0, help="coordinator's port")
  p.add_argument('--workdir', action='append', required=True)
  p.add_argument('--out', required=True)
  p.add_argument('--preset', default='decoupled_token_is')
  p.add_argument('--num_steps', type=int, default=2)
  p.add_argument('--sft_steps', type=int, default=0)
  p.add_argument(
    '--compile_cache',
    default='',
    help='persistent compilation cache: a second workdir in the same '
    'process then compiles nothing',
  )
  p.add_argument(
    '--set',
    action='append',
    default=[],
    metavar='[WORKDIR:]SECTION.FIELD=VALUE',
    help='config override (repeatable), of one workdir (its basename) or '
    'of all',
  )
  p.add_argument(
    '--rollouts',
    default='',
    help="folder for each process's trained rows (module docstring)",
  )
  p.add_argument(
    '--preempt',
    default='',
    metavar='WORKDIR:STEP',
    help='SIGTERM after that workdir trained that step',
  )
  p.add_argument(
    '--kill',
    default='',
    metavar='WORKDIR:STEP',
    help="SIGKILL once that workdir's metrics line of that step is written",
  )
  return p.parse_args(argv)


def apply_overrides(config: Any, overrides: list[str], run: str) -> Any:
  """A copy of `config` with the `--set` items of all workdirs and of `run`
  (a value is a Python literal, else the string)."""
  import ast

  config = config.copy_and_resolve_references()
  for item in overrides:
    path, _, text = item.partition('=')
    name, _, path = path.rpartition(':')
    if name and name != run:
      continue
    section, field = path.split('.')
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    config[section][field] = value
  return config


def record_rollouts(trainer: Any, run: str, arrays: dict) -> None:
  """Wraps `trainer.train_on` to copy each step's local rows to
  `arrays['<run>/step<s>/<field>']` (s = the step it trains, from 1)."""
  import numpy as np

  train_on = trainer.train_on

  def recording(scored: Any) -> Any:
    prefix = f'{run}/step{scored.step + 1}'
    for field in ROLLOUT_FIELDS:
      arrays[f'{prefix}/{field}'] = np.asarray(getattr(scored.batch, field))
    arrays[f'{prefix}/rewards'] = np.asarray(scored.rewards)
    return train_on(scored)

  trainer.train_on = recording


def preempt_after(trainer: Any, step: int) -> None:
  """Wraps `trainer.train_on` to send this process SIGTERM right after
  training step `step` (from 1); the loop's guard turns it into a stop."""
  import signal

  train_on = trainer.train_on

  def training(scored: Any) -> Any:
    out = train_on(scored)
    if scored.step + 1 == step:
      os.kill(os.getpid(), signal.SIGTERM)
    return out

  trainer.train_on = training


def kill_after(trainer: Any, step: int) -> None:
  """Wraps `trainer.writer.write` to SIGKILL this process right after the
  metrics line of step `step` is written (and flushed)."""
  import signal

  write = trainer.writer.write

  def writing(s: int, metrics: Any) -> None:
    write(s, metrics)
    if s == step:
      os.kill(os.getpid(), signal.SIGKILL)

  trainer.writer.write = writing


def host_params(trainer: Any, params: Any) -> dict[str, Any]:
  """`{'layers/0/...': np.ndarray}` of a params tree, gathered from every
  process (a collective with several processes: all must call it)."""
  import numpy as np
  from flax import nnx
  from jax.experimental import multihost_utils

  if trainer.process_count > 1:
    params = multihost_utils.process_allgather(params, tiled=True)
  pure = jax.device_get(nnx.to_pure_dict(params))
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
    key = '/'.join(str(getattr(k, 'key', k)) for k in path)
    out[key] = np.asarray(leaf)
  return out


def checkpoint_params(trainer: Any, step: int) -> Any:
  """The policy params of checkpoint `step`, restored into this job's
  shardings (the trainer's state and metrics file are left alone)."""
  from jaxcorr.train.checkpoints.tree import abstract_like

  ref_like = trainer.state.params if trainer.run.needs_ref else None
  tree = {'state': trainer.state, 'ref': ref_like}
  restored, _ = trainer.checkpointer.restore(abstract_like(tree), step=step)
  return restored['state'].params


def main(argv: list[str]) -> None:
  args = parse_args(argv)
  # Before any other JAX use: the backend starts with this device count.
  jax.config.update('jax_platforms', 'cpu')
  jax.config.update('jax_num_cpu_devices', args.devices)
  if args.compile_cache:
    jax.config.update('jax_compilation_cache_dir', args.compile_cache)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  sys.path.insert(0, REPO)
  from jaxcorr import distributed

  if args.processes > 1:
    distributed.initialize(
      coordinator_address=f'localhost:{args.port}',
      num_processes=args.processes,
      process_id=args.process_id,
    )
  import numpy as np

  from jaxcorr import rewards as reward_fns
  from jaxcorr.train.loop import Trainer
  from tests.helpers.trainer_config import pulse_config

  assert jax.process_count() == args.processes, jax.process_count()
  assert jax.device_count() == args.devices * args.processes
  # An untrained pulse model never solves a problem, and learns within a
  # step to fill a length reward's budget. A reward that scatters responses
  # (their characters' code points mod 7) keeps GRPO groups' rewards apart,
  # hence non-zero advantages at every step.
  reward_fns.register(REWARD)(
    lambda response, answer: sum(map(ord, response)) % 7 / 7
  )
  name = f'pulse+{args.preset}'
  # A learning rate that does not depend on num_steps: the test compares a
  # job stopped after step 2 with one that goes on to step 3.
  config = pulse_config(
    args.preset,
    reward__functions=f'exact_match,{REWARD}',
    train__num_steps=args.num_steps,
    train__sft_steps=args.sft_steps,
    train__eval_every=0,
    train__loggers='jsonl',
    optim__schedule='constant',
    optim__warmup_steps=0,
  )
  arrays = {}
  rollouts = {}
  base = config
  for workdir in args.workdir:
    run = os.path.basename(os.path.normpath(workdir))
    config = apply_overrides(base, args.set, run)
    trainer = Trainer.from_config(config, workdir, config_name=name)
    if args.rollouts:
      record_rollouts(trainer, run, rollouts)
    if args.preempt.rpartition(':')[0] == run:
      preempt_after(trainer, int(args.preempt.rpartition(':')[2]))
    if args.kill.rpartition(':')[0] == run:
      kill_after(trainer, int(args.kill.rpartition(':')[2]))
    trainer.train()
    final = host_params(trainer, trainer.state.params)
    arrays.update({f'{run}/final/{k}': v for k, v in final.items()})
    for step in trainer.checkpointer.all_steps():
      params = host_params(trainer, checkpoint_params(trainer, step))
      arrays.update({f'{run}/step{step}/{k}': v for k, v in params.items()})
    trainer.close()
  if jax.process_index() == 0:
    np.savez(args.out, **arrays)
  if args.rollouts:
    os.makedirs(args.rollouts, exist_ok=True)
    np.savez(f'{args.rollouts}/p{args.process_id}.npz', **rollouts)
  print(f'DONE process {args.process_id}', flush=True)


if __name__ == '__main__':
  main(sys.argv[1:])
