"""A `Plan` as the text `python -m jaxcorr.plan` prints: what one device
holds, each compiled program's memory and collective traffic, and the
headroom on a chip's HBM."""

from __future__ import annotations

from jaxcorr.plan.collectives import KINDS
from jaxcorr.plan.programs import Plan, Program

_UNITS = (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10))


def _gb(n: float) -> str:
  """Bytes in the largest binary unit they fill (HBM is quoted in GiB)."""
  for unit, size in _UNITS:
    if abs(n) >= size:
      return f'{n / size:7.2f} {unit}'
  return f'{n:7.0f} B  '


def _program(plan: Plan, name: str) -> Program:
  return next(p for p in plan.programs if p.name == name)


def trainer_peak(plan: Plan) -> int:
  """The larger of `prepare`'s and `update`'s peaks (per device)."""
  return max(_program(plan, n).peak_bytes for n in ('prepare', 'update'))


def phase_peaks(plan: Plan) -> dict[str, int]:
  """Sync mode, the engine on the trainer's chips, per device: while
  decoding, the decode chunk's peak beside the trainer's params, optimizer
  and reference; while training, the trainer's peak beside the engine's
  params (the decode state lives only during a rollout)."""
  held = plan.param_bytes + plan.optimizer_bytes + plan.ref_bytes
  return {
    'rollout': _program(plan, 'decode_chunk').peak_bytes + held,
    'update': trainer_peak(plan) + plan.engine_param_bytes,
  }


def _program_lines(p: Program) -> list[str]:
  lines = [
    f'  {p.name:<13} args {_gb(p.argument_bytes)}  temp {_gb(p.temp_bytes)}'
    f'  out {_gb(p.output_bytes)}  aliased {_gb(p.alias_bytes)}'
    f'  peak {_gb(p.peak_bytes)}  (compiled in {p.compile_s:.0f} s)'
  ]
  for kind in KINDS:
    t = p.traffic.kinds[kind]
    if t.count:
      lines.append(
        f'      {kind:<19} x{t.count:<6} in {_gb(t.operand_bytes)}'
        f'  out {_gb(t.result_bytes)}'
      )
  if p.traffic.unknown_loops:
    lines.append(
      f'      ({p.traffic.unknown_loops} loop(s) of unknown trip count '
      'counted at their bound)'
    )
  return lines


def format_plan(plan: Plan, hbm: dict[str, int]) -> str:
  """The report; `hbm`: chip name -> HBM bytes to compare with."""
  c = plan.config
  lines = [
    f'model: {plan.param_count / 1e9:.2f}B params, {c.num_layers} layers, '
    f'd={c.hidden_size}, mlp={c.intermediate_size}, heads={c.num_heads}/'
    f'{c.num_kv_heads}, vocab={c.vocab_size}, {c.dtype} compute, '
    f'{c.param_dtype} params, remat={c.remat}, scan_layers={c.scan_layers}',
    f'trainer: {plan.train_devices} devices, {plan.batch_rows} rows per '
    f'step; engine: {plan.engine_devices} devices',
    'per device, held between calls:',
    f'  params         {_gb(plan.param_bytes)}',
    f'  optimizer      {_gb(plan.optimizer_bytes)}',
    f'  reference      {_gb(plan.ref_bytes)}',
    f'  step batch     {_gb(plan.batch_bytes)}',
    f'  engine params  {_gb(plan.engine_param_bytes)}',
    f'  engine KV      {_gb(plan.kv_bytes)}',
    'compiled programs, per device and per call (collective bytes: what '
    'each device puts in / gets out):',
  ]
  for p in plan.programs:
    lines += _program_lines(p)
  phases = phase_peaks(plan)
  need = max(phases.values())
  lines.append(
    'per chip in sync mode: '
    + ', '.join(f'{k} phase {_gb(v)}' for k, v in phases.items())
  )
  for chip, size in hbm.items():
    verdict = 'fits' if need <= size else 'does NOT fit'
    lines.append(
      f'  {chip}: {_gb(size)} HBM, {_gb(size - need)} left ({verdict})'
    )
  return '\n'.join(lines)
