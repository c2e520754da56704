"""Hugging Face checkpoints in and out: `load_hf`, `save_hf`, `load_tokenizer`.

Local directories only (`config.json` + `model.safetensors`, or shards
listed in `model.safetensors.index.json`), read with `safetensors` and
`tokenizers`; no hub access, no torch.

Loading never holds the whole model on the host: the model is built
abstractly (`nnx.eval_shape`), every tensor's name, shape and presence is
checked against the config from the file headers alone, and then each param
is placed straight into its sharding with `jax.make_array_from_callback`,
which asks for the shards this host's devices own. Host memory peaks at one
HF tensor (converted once, sliced per device). Scanned layers ([L, ...]
params) are filled one layer at a time into a donated on-device buffer.

Layout: HF `nn.Linear` weights are [out, in]; ours are [in..., out...] with
heads split out. `_LAYER_PARAMS` records, per param, the HF name and its
`Layout`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors)
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxcorr.model.config import TransformerConfig
from jaxcorr.model.transformer import Transformer
from jaxcorr.sharding import param_shardings

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
TOKENIZER_FILES = (
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'generation_config.json',
  'vocab.json',
  'merges.txt',
)

Layout = int | str | None
"""How our param maps to HF's: 'same' (identical), None (HF is the flattened
param: biases, norms), k (HF [out, in] is our [in..., out...] transposed, the
first k dims forming `in`)."""

_GLOBAL_PARAMS = {
  ('embed',): ('model.embed_tokens.weight', 'same'),
  ('final_norm', 'scale'): ('model.norm.weight', 'same'),
  ('lm_head',): ('lm_head.weight', 'same'),
}
_LAYER_PARAMS = {
  ('attn_norm', 'scale'): ('input_layernorm.weight', None),
  ('attn', 'q_proj', 'kernel'): ('self_attn.q_proj.weight', 1),
  ('attn', 'q_proj', 'bias'): ('self_attn.q_proj.bias', None),
  ('attn', 'k_proj', 'kernel'): ('self_attn.k_proj.weight', 1),
  ('attn', 'k_proj', 'bias'): ('self_attn.k_proj.bias', None),
  ('attn', 'v_proj', 'kernel'): ('self_attn.v_proj.weight', 1),
  ('attn', 'v_proj', 'bias'): ('self_attn.v_proj.bias', None),
  ('attn', 'o_proj', 'kernel'): ('self_attn.o_proj.weight', 2),
  ('attn', 'o_proj', 'bias'): ('self_attn.o_proj.bias', None),
  ('attn', 'q_norm', 'scale'): ('self_attn.q_norm.weight', None),
  ('attn', 'k_norm', 'scale'): ('self_attn.k_norm.weight', None),
  ('mlp_norm', 'scale'): ('post_attention_layernorm.weight', None),
  ('mlp', 'gate_proj', 'kernel'): ('mlp.gate_proj.weight', 1),
  ('mlp', 'up_proj', 'kernel'): ('mlp.up_proj.weight', 1),
  ('mlp', 'down_proj', 'kernel'): ('mlp.down_proj.weight', 1),
}
# MoE layers ({moe}: the block's HF prefix, {e}: the expert; names per
# family in _MOE_NAMES). Ours stack the experts: [E, D, F] / [E, F, D].
_MOE_LAYER_PARAMS = {
  ('mlp', 'router'): ('{moe}.gate.weight', 1),
  ('mlp', 'gate_proj'): ('{moe}.experts.{e}.{gate}.weight', 1),
  ('mlp', 'up_proj'): ('{moe}.experts.{e}.{up}.weight', 1),
  ('mlp', 'down_proj'): ('{moe}.experts.{e}.{down}.weight', 1),
  ('mlp', 'shared_expert', 'gate_proj', 'kernel'): (
    'mlp.shared_expert.gate_proj.weight',
    1,
  ),
  ('mlp', 'shared_expert', 'up_proj', 'kernel'): (
    'mlp.shared_expert.up_proj.weight',
    1,
  ),
  ('mlp', 'shared_expert', 'down_proj', 'kernel'): (
    'mlp.shared_expert.down_proj.weight',
    1,
  ),
  ('mlp', 'shared_gate', 'kernel'): ('mlp.shared_expert_gate.weight', 1),
}
_MOE_NAMES = {
  'MixtralForCausalLM': dict(
    moe='block_sparse_moe', gate='w1', up='w3', down='w2'
  ),
  'default': dict(moe='mlp', gate='gate_proj', up='up_proj', down='down_proj'),
}


def moe_module_names(architecture: str) -> dict[str, str]:
  """HF names of an MoE block (`moe`: its prefix in a layer) and of its
  experts' projections (`gate_proj`, `up_proj`, `down_proj`: ours -> HF's:
  Mixtral's `w1`, `w3`, `w2`) for `architecture`."""
  f = _MOE_NAMES.get(architecture, _MOE_NAMES['default'])
  return dict(
    moe=f['moe'], gate_proj=f['gate'], up_proj=f['up'], down_proj=f['down']
  )


# Present in some checkpoints, never needed (recomputed from the config).
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)


class WeightsMismatchError(ValueError):
  """A Hugging Face weights directory whose tensors do not match its
  config.json (missing, unexpected or misshapen).

  Not to be confused with
  `jaxcorr.train.checkpoints.restore.CheckpointRestoreError`, a training
  checkpoint step that cannot be restored; both are ValueErrors, the one
  base they share.
  """


# ----------------------------------------------------------- name mapping


class _Entry(NamedTuple):
  path: tuple[Any, ...]  # param path in the NNX state
  var: nnx.Variable
  names: list[tuple[tuple[int, ...], str]]  # (index into the lead axes, name)
  layout: Layout
  lead: int  # leading axes split into HF tensors: scanned [L], experts [E]

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return _hf_shape(tuple(self.var.shape)[self.lead :], self.layout)


def _param_entries(cfg: TransformerConfig, state: nnx.State) -> list[_Entry]:
  """Every param with its HF tensor name(s) and layout."""
  entries = []
  fmt = _MOE_NAMES.get(cfg.architecture, _MOE_NAMES['default'])
  for path, var in nnx.to_flat_state(state):
    path = tuple(path)
    if path[0] != 'layers':
      name, layout = _GLOBAL_PARAMS[path]
      entries.append(_Entry(path, var, [((), name)], layout, 0))
      continue
    if cfg.scan_layers:
      key, layers = path[1:], range(cfg.num_layers)
    else:
      key, layers = path[2:], [path[1]]
    scan = (0,) if cfg.scan_layers else ()
    suffix, layout = _LAYER_PARAMS.get(key) or _MOE_LAYER_PARAMS[key]
    experts = range(cfg.num_experts) if '{e}' in suffix else [None]
    names = [
      (
        (i,) * bool(scan) + (() if e is None else (e,)),
        f'model.layers.{i}.' + suffix.format(e=e, **fmt),
      )
      for i in layers
      for e in experts
    ]
    lead = len(scan) + ('{e}' in suffix)
    entries.append(_Entry(path, var, names, layout, lead))
  return entries


def _hf_shape(shape: tuple[int, ...], n_in: Layout) -> tuple[int, ...]:
  """HF shape of a param whose (per-layer) shape is `shape`."""
  if n_in == 'same':
    return shape
  if n_in is None:
    return (math.prod(shape),)
  return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _to_ours(x: np.ndarray, shape: tuple[int, ...], n_in: Layout) -> np.ndarray:
  return x.reshape(shape) if n_in in (None, 'same') else x.T.reshape(shape)


def _to_hf(x: np.ndarray, n_in: Layout) -> np.ndarray:
  if n_in == 'same':
    return np.ascontiguousarray(x)
  if n_in is None:
    return np.ascontiguousarray(x.reshape(-1))
  return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n_in]), -1).T)


# ----------------------------------------------------------------- reading


class _Reader:
  """Tensors of a local safetensors checkpoint (single file or sharded)."""

  def __init__(self, path: str, stack: contextlib.ExitStack):
    from safetensors import safe_open

    index, single = (
      os.path.join(path, INDEX_FILE),
      os.path.join(path, SINGLE_FILE),
    )
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f)['weight_map']
    elif os.path.isfile(single):
      weight_map = None
    else:
      raise FileNotFoundError(
        f'no {SINGLE_FILE} or {INDEX_FILE} in {path!r} (only safetensors '
        'checkpoints are read; convert .bin/.pt files with transformers first)'
      )
    files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    self.files = {}
    for name in files:
      full = os.path.join(path, name)
      if not os.path.isfile(full):
        raise FileNotFoundError(
          f'{INDEX_FILE} lists {name}, missing in {path!r}'
        )
      self.files[name] = stack.enter_context(safe_open(full, framework='numpy'))
    if weight_map is None:
      weight_map = {k: SINGLE_FILE for k in self.files[SINGLE_FILE].keys()}  # noqa: SIM118 (not a dict)
    self.weight_map = weight_map

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.files[self.weight_map[name]].get_slice(name).get_shape())

  def read(self, name: str) -> np.ndarray:
    return self.files[self.weight_map[name]].get_tensor(name)


def _check(reader: _Reader, cfg: TransformerConfig, entries, path: str):
  """Every needed tensor present with the config's shape, nothing unknown."""
  expected = {name: e.hf_shape for e in entries for _, name in e.names}
  present = set(reader.weight_map)
  missing = sorted(set(expected) - present)
  extra = sorted(
    k
    for k in present - set(expected)
    if not k.endswith(_IGNORED_SUFFIXES)
    and not (k == 'lm_head.weight' and cfg.tie_embeddings)
  )
  if missing or extra:
    raise WeightsMismatchError(
      f'checkpoint {path!r} does not match its {cfg.architecture} config: '
      f'missing {missing[:8]}{"..." if len(missing) > 8 else ""}, '
      f'unexpected {extra[:8]}{"..." if len(extra) > 8 else ""}'
    )
  for name, shape in expected.items():
    got = reader.shape(name)
    if got != shape:
      raise WeightsMismatchError(
        f'{name} in {path!r} has shape {got}, but config.json implies {shape}'
      )


def _place(reader, name, shape, n_in, sharding, dtype) -> jax.Array:
  """One HF tensor, converted once on the host, placed shard by shard."""
  cache: dict[str, np.ndarray] = {}

  def shard(index):
    if 'x' not in cache:
      cache['x'] = _to_ours(reader.read(name), shape, n_in).astype(dtype)
    return cache['x'][index]

  return jax.make_array_from_callback(shape, sharding, shard)


def _place_stacked(
  reader, names, shape, n_in, sharding, part_sharding, dtype, lead
) -> jax.Array:
  """A param stacked over `lead` axes (scanned layers [L], experts [E]),
  filled one HF tensor at a time into a donated on-device buffer (so neither
  host nor device holds two copies)."""
  buf = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()

  def put(b, x, idx):
    start = tuple(idx) + (0,) * (b.ndim - lead)
    return jax.lax.dynamic_update_slice(b, x[(None,) * lead], start)

  write = jax.jit(put, donate_argnums=0, out_shardings=sharding)
  for idx, name in names:
    part = _place(reader, name, shape[lead:], n_in, part_sharding, dtype)
    buf = write(buf, part, jnp.asarray(idx, jnp.int32))
  return buf


def load_hf(
  path: str | os.PathLike,
  *,
  mesh: jax.sharding.Mesh | None = None,
  param_dtype: Any = 'float32',
  dtype: Any = None,
  **overrides: Any,
) -> Transformer:
  """A `Transformer` with the weights of the HF checkpoint directory `path`.

  Args:
    path: directory with config.json and safetensors weights.
    mesh: place each param in its `jaxcorr.sharding` sharding on this mesh
      (None: the first device).
    param_dtype: storage dtype of the params (the checkpoint is cast).
    dtype: compute dtype (default: `param_dtype`).
    **overrides: other `TransformerConfig` fields (`scan_layers`, `remat`,
      `matmul_precision`, ...).
  """
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'no checkpoint directory {path!r}')
  cfg = TransformerConfig.from_hf_config(
    path, param_dtype=param_dtype, dtype=dtype or param_dtype, **overrides
  )
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  entries = _param_entries(cfg, state)
  if mesh is not None:
    shardings = dict(nnx.to_flat_state(param_shardings(state, mesh)))
  dev = SingleDeviceSharding(jax.devices()[0])
  with contextlib.ExitStack() as stack:
    reader = _Reader(path, stack)
    _check(reader, cfg, entries, path)
    values = {}
    for p, var, names, n_in, lead in entries:
      shape, dt = tuple(var.shape), cfg.param_dtype
      sharding = dev if mesh is None else shardings[p].get_value()
      if not lead:
        values[p] = _place(reader, names[0][1], shape, n_in, sharding, dt)
        continue
      part_sharding = sharding
      if isinstance(sharding, NamedSharding):
        spec = PartitionSpec(*sharding.spec[lead:])
        part_sharding = NamedSharding(mesh, spec)
      values[p] = _place_stacked(
        reader, names, shape, n_in, sharding, part_sharding, dt, lead
      )
  for p, var in nnx.to_flat_state(state):
    var.set_value(values[tuple(p)])
  return model


def load_tokenizer(path: str | os.PathLike):
  """The `tokenizers.Tokenizer` of a local checkpoint dir (tokenizer.json)."""
  from tokenizers import Tokenizer

  file = os.path.join(os.fspath(path), 'tokenizer.json')
  if not os.path.isfile(file):
    raise FileNotFoundError(f'no tokenizer.json in {os.fspath(path)!r}')
  return Tokenizer.from_file(file)


# ----------------------------------------------------------------- writing


def _to_host(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf(
  model: Transformer,
  path: str | os.PathLike,
  *,
  dtype: Any = None,
  max_shard_bytes: int = 5 * 2**30,
  tokenizer_dir: str | os.PathLike | None = None,
) -> None:
  """Write `model` as a HF checkpoint directory `transformers` can load.

  Tensors are gathered one at a time (one layer at a time when scanned),
  cast to `dtype` (default: the param dtype) and written in safetensors
  files of at most `max_shard_bytes` (several files get an index). Tokenizer
  files are copied from `tokenizer_dir` when given. Every process must call
  this (params are gathered collectively); only process 0 writes.
  """
  from safetensors.numpy import save_file

  cfg = model.config
  dtype = jnp.dtype(dtype or cfg.param_dtype)
  hf_config = cfg.to_hf_config(dtype)  # raises before anything is written
  path = os.fspath(path)
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
  state = nnx.state(model, nnx.Param)
  meta = {'format': 'pt'}
  # Streamed: a shard is written (under a temporary name, as the file count
  # is known only at the end) as soon as it is full.
  files: list[tuple[str, list[str]]] = []
  shard: dict[str, np.ndarray] = {}
  size = total = 0

  def flush():
    nonlocal shard, size
    if shard and writer:
      tmp = os.path.join(path, f'.tmp-{len(files):05d}.safetensors')
      save_file(shard, tmp, metadata=meta)
    files.append((f'.tmp-{len(files):05d}.safetensors', list(shard)))
    shard, size = {}, 0

  for _, var, names, n_in, _ in _param_entries(cfg, state):
    value = var.get_value()
    for idx, name in names:
      x = value[idx] if idx else value
      x = _to_hf(_to_host(x).astype(dtype), n_in)
      if size and size + x.nbytes > max_shard_bytes:
        flush()
      shard[name] = x
      size += x.nbytes
      total += x.nbytes
  flush()
  if not writer:
    return
  if len(files) == 1:
    os.replace(os.path.join(path, files[0][0]), os.path.join(path, SINGLE_FILE))
  else:
    weight_map = {}
    for k, (tmp, names) in enumerate(files):
      fname = f'model-{k + 1:05d}-of-{len(files):05d}.safetensors'
      os.replace(os.path.join(path, tmp), os.path.join(path, fname))
      weight_map.update({name: fname for name in names})
    index = {'metadata': {'total_size': total}, 'weight_map': weight_map}
    with open(os.path.join(path, INDEX_FILE), 'w') as f:
      json.dump(index, f, indent=2)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(hf_config, f, indent=2)
  if tokenizer_dir is not None:
    for name in TOKENIZER_FILES:
      src = os.path.join(os.fspath(tokenizer_dir), name)
      if os.path.isfile(src):
        shutil.copy(src, os.path.join(path, name))
