"""The trainer's `rollout` section: sampling with the JetStream engine, sync,
async or streaming (docs/rollout.md, docs/async.md).

One frozen dataclass of `setting`s, read by the producers beside it
(jaxcorr/train/rollouts/); `jaxcorr.train.build` lists it among the run's
sections. Its `__post_init__` checks the fields and the rules between them
(which fields only make sense with which `mode`).
"""

from __future__ import annotations

import dataclasses

from jaxcorr.config.fields import (
  DTYPES,
  boolean,
  fail,
  integer,
  number,
  one_of,
  optional,
  setting,
  validate,
)

STALENESS_POLICIES = ('wait', 'drop', 'mask')
"""`rollout.staleness_policy` (jaxcorr/train/rollouts/staleness.py)."""
STREAM_ONLY = {'weight_sync': 'latest', 'kv_on_update': 'keep'}
"""Fields only `mode='stream'` reads -> their default, the one value allowed
with the other modes."""
_POS, _NAT = integer(1), integer(0)
KV_CACHE_DTYPES = ('model', 'float32', 'bfloat16', 'float16', 'int8', 'fp8')
"""`rollout.kv_cache_dtype` ('model': engine_dtype;
`jaxcorr.rollout.precision.kv_storage_dtype` maps them)."""


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Sampling with the JetStream engine, sync or async."""

  prompts_per_step: int = setting(
    16,
    _POS,
    'Prompts per RL step; the batch is prompts_per_step * '
    'samples_per_prompt sequences.',
  )
  samples_per_prompt: int = setting(
    8, _POS, 'Samples per prompt (the GRPO group size).'
  )
  max_prompt_length: int = setting(
    32, _POS, 'Longest prompt in tokens (a longer prompt is an error).'
  )
  max_new_tokens: int = setting(16, _POS, 'Response length cap.')
  temperature: float = setting(
    1.0,
    number(0, lo_open=True),
    'Sampling temperature; the trainer scores with the same one.',
  )
  top_k: int = setting(0, _NAT, 'Top-k truncation (0: off).')
  top_p: float = setting(
    1.0, number(0, 1, lo_open=True), 'Nucleus truncation (1: off).'
  )
  min_p: float = setting(
    0.0, number(0, 1, hi_open=True), 'Min-p truncation (0: off).'
  )
  logprob_mode: str = setting(
    'full',
    one_of('full', 'truncated', 'replay'),
    "μ for the correction: 'full' (verl), 'truncated' (of the truncated "
    "sampling distribution) or 'replay' (the engine records each token's "
    'kept set and the trainer renormalises over it: rollout/kept_set.py).',
  )
  kept_set_capacity: int = setting(
    64,
    _POS,
    "logprob_mode='replay': kept ids stored per token; a wider set keeps "
    'its most probable ids and counts as capped (at most 1% of tokens).',
  )
  max_concurrent_decodes: int = setting(64, _POS, 'Engine decode slots.')
  decode_chunk: int = setting(
    32,
    _POS,
    'Engine decode steps per device dispatch: the host reads tokens and '
    'refills freed slots between dispatches (docs/rollout.md).',
  )
  engine_dtype: str = setting(
    'float32',
    one_of(*DTYPES),
    'Engine parameter/compute dtype: a bf16 engine is the usual '
    'training/inference mismatch.',
  )
  # Two knobs, two things: `simulated_quant` only perturbs the values the
  # engine receives (the mismatch lab's controlled mismatch), while
  # `quantization` is a real narrow engine (int8 / fp8 storage).
  simulated_quant: str = setting(
    'none',
    one_of('none', 'int8'),
    "Simulated engine weight quantization (the mismatch lab's injector; "
    "formerly engine_quant): 'int8' sends the engine a per-row int8 "
    'quantize-dequantize copy of the weights, still stored and computed '
    'in engine_dtype. For a real narrow engine use rollout.quantization.',
  )
  quantization: str = setting(
    'none',
    one_of('none', 'int8', 'fp8'),
    "Engine weights stored narrow on the engine's devices: 'int8' or "
    "'fp8' (e4m3) with float32 absmax scales per output channel, "
    're-quantized from the published weights at every sync '
    "(docs/precision.md); 'none' keeps engine_dtype.",
  )
  quantization_block: int = setting(
    0,
    _NAT,
    'quantization: 0 one scale per output channel; n > 0 one per output '
    'channel and block of n consecutive inputs (head-major for o_proj); n '
    "must tile every matmul weight's inputs (docs/precision.md).",
  )
  quantize_activations: bool = setting(
    False,
    boolean,
    'quantization: also quantize activations per token (W8A8: int8 dots '
    'everywhere, fp8 dots on GPUs only); False: weight-only.',
  )
  kv_cache_dtype: str = setting(
    'model',
    one_of(*KV_CACHE_DTYPES),
    "Engine KV cache storage: 'model' (engine_dtype), a float dtype no "
    "wider than it, or 'int8' / 'fp8' (one float32 scale per token and "
    'KV head; attention reads the narrow values).',
  )
  matched_precision: bool = setting(
    False,
    boolean,
    "quantization: compute π_old with the engine's quantized weights "
    '(fake-quant forward in prepare) instead of the trainer precision, '
    'removing the weight part of the gap instead of correcting it.',
  )
  exact: bool = setting(
    False,
    boolean,
    "Exact mode: the engine's log-probs equal the trainer's π_old bit for "
    'bit whatever the batch, slot or prompt length (fixed token tiles, '
    'attention over the whole cache, π_old in engine_dtype: docs/rollout.md '
    '"Exact mode"); unquantized engines, logprob_mode=\'full\'.',
  )
  mode: str = setting(
    'sync',
    one_of('sync', 'async', 'stream'),
    "'sync' (rollout with the current weights, then train), 'async' (a "
    'producer thread samples batch s with the weights of step s - '
    "max_staleness) or 'stream' (continuous decoding across batches; new "
    'weights enter the engine between decode chunks, mid-sequence: '
    'docs/async.md).',
  )
  weight_sync: str = setting(
    'latest',
    one_of('latest', 'scheduled'),
    'stream: at a chunk boundary the engine takes the newest published '
    "weights ('latest', PipelineRL; timing decides which tokens each "
    'version samples) or exactly version max(start, batches done - 1) '
    "('scheduled': reproducible, waits for it; staleness_policy='wait').",
  )
  kv_on_update: str = setting(
    'keep',
    one_of('keep', 'recompute'),
    'stream: after a weight update, in-flight rows attend to the KV cache '
    "their older weights wrote ('keep', PipelineRL) or the engine "
    "recomputes it under the new weights first ('recompute': one forward "
    'over every live row).',
  )
  staleness_policy: str = setting(
    'wait',
    one_of(*STALENESS_POLICIES),
    "'wait': the producer waits for the weights a batch needs, so no token "
    "is older than max_staleness versions; stream only: 'drop' (a row "
    "with a token older than that leaves the loss) or 'mask' (only those "
    'tokens leave the loss), where the producer waits only when nothing '
    'it would sample next could train.',
  )
  rollout_devices: int = setting(
    0,
    _NAT,
    'async, stream: devices of the rollout sub-mesh (the rest train); 0 '
    'shares the '
    "trainer's devices.",
  )
  queue_size: int = setting(
    1,
    _POS,
    'async: batches waiting in the queue; stream (drop, mask): batches '
    'decoded ahead of the one the trainer is on.',
  )
  max_staleness: int | None = setting(
    None,
    optional(_NAT, 'unlimited; sync mode only'),
    'Rows older than this many policy versions are dropped; async mode '
    'also never samples further ahead. None: unlimited (sync).',
  )
  allow_nonfinite_logp: bool = setting(
    False,
    boolean,
    'Non-finite rollout log-probs go to the in-graph rejection (True) or '
    'fail host validation (False).',
  )
  max_error_fraction: float = setting(
    0.0,
    number(0, 1),
    'Largest tolerated fraction of ERROR rows before the loop raises.',
  )
  max_empty_batches: int = setting(
    2,
    _NAT,
    'Batches in a row with no token left to train (every row dropped or '
    'masked as too stale, or an engine error) tolerated, each with a '
    'warning, before the run stops; 0 stops at the first.',
  )

  def __post_init__(self):
    p = validate(self)
    self._check_precision(p)
    self._check_exact(p)
    if self.mode != 'sync' and self.max_staleness is None:
      fail(
        f'{p}.max_staleness',
        None,
        f'an int >= 0 with rollout.mode={self.mode!r} (the producer may '
        'not run further ahead than this many policy versions)',
      )
    if self.staleness_policy != 'wait' and self.mode != 'stream':
      fail(
        f'{p}.staleness_policy',
        self.staleness_policy,
        f"'wait' with rollout.mode={self.mode!r} ('drop' and 'mask' need "
        "mode='stream', the only producer that runs ahead of the weights)",
      )
    if self.mode != 'stream':
      for name, default in STREAM_ONLY.items():
        value = getattr(self, name)
        if value != default:
          fail(
            f'{p}.{name}',
            value,
            f'{default!r} with rollout.mode={self.mode!r} ({name} is read '
            "only by mode='stream')",
          )
    if self.weight_sync == 'scheduled' and self.staleness_policy != 'wait':
      fail(
        f'{p}.weight_sync',
        self.weight_sync,
        "'latest' with staleness_policy="
        f"{self.staleness_policy!r} ('scheduled' waits for each version)",
      )

  def _check_precision(self, p: str) -> None:
    if self.quantization != 'none' and self.simulated_quant != 'none':
      fail(
        f'{p}.simulated_quant',
        self.simulated_quant,
        "'none' with rollout.quantization set (simulated_quant only "
        'perturbs the weights the engine gets; quantization stores them '
        'narrow: one or the other)',
      )
    if self.quantization == 'none':
      for name, off in (
        ('quantization_block', 0),
        ('quantize_activations', False),
        ('matched_precision', False),
      ):
        if getattr(self, name) != off:
          fail(
            f'{p}.{name}',
            getattr(self, name),
            f"{off!r} with rollout.quantization='none' (it configures the "
            'quantized engine)',
          )
    kv = self.kv_cache_dtype
    widths = {'float32': 4, 'bfloat16': 2, 'float16': 2}
    if widths.get(kv, 1) > widths[self.engine_dtype]:
      fail(
        f'{p}.kv_cache_dtype',
        kv,
        f"no wider than engine_dtype={self.engine_dtype!r} ('model', a "
        "narrower float, 'int8' or 'fp8')",
      )

  def _check_exact(self, p: str) -> None:
    """Settings exact mode cannot make bit-equal fail at config time."""
    if not self.exact:
      return
    for name, ok, allowed in (
      ('quantization', 'none', "'none' (narrow weights differ by design)"),
      ('logprob_mode', 'full', "'full' (the exact log-softmax)"),
    ):
      if getattr(self, name) != ok:
        fail(f'{p}.{name}', getattr(self, name), f'{allowed} with {p}.exact')
    if self.kv_cache_dtype not in ('model', self.engine_dtype):
      fail(
        f'{p}.kv_cache_dtype',
        self.kv_cache_dtype,
        f"'model' with {p}.exact (the cache in engine_dtype)",
      )

  @property
  def batch_size(self) -> int:
    return self.prompts_per_step * self.samples_per_prompt

  @property
  def truncation(self) -> bool:
    return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
