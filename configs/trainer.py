"""The trainer's config sections: model, data, rollout, reward, train, optim,
critic, mesh.

`configs/base.py` assigns each of them in `base_config`; a task config
(`configs/arith_tiny.py`, `configs/gsm8k_qwen.py`, ...) changes their
values, never their keys. `jaxcorr.train.run_config.build` turns them into
frozen dataclasses at start-up and validates every field there (a
`ValueError` naming `config.<section>.<field>`, the value and the allowed
values).
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def model_section() -> ml_collections.ConfigDict:
  """The policy: a local Hugging Face checkpoint or a model from scratch."""
  m = ml_collections.ConfigDict()
  # Local HF directory (config.json, *.safetensors, tokenizer.json); '' builds
  # a randomly initialised model from the shape fields below.
  m.hf_path = ''
  # Shape of a model built from scratch (ignored with hf_path).
  m.vocab_size = 32
  m.hidden_size = 128
  m.intermediate_size = 384
  m.num_layers = 2
  m.num_heads = 4
  m.num_kv_heads = 2
  m.tie_embeddings = True
  m.rope_theta = 10_000.0
  m.max_position_embeddings = 512
  # Std of the random init (scratch models).
  m.initializer_range = 0.02
  # Trainer compute dtype ('float32', 'bfloat16'); log-probs are float32.
  m.dtype = 'float32'
  # Stored parameter dtype of the trained policy.
  m.param_dtype = 'float32'
  # Activation checkpointing: 'none', 'full' or 'dots'.
  m.remat = 'none'
  # Scan over layers (one layer compiled once; long models).
  m.scan_layers = False
  # Positions per chunk of the chunked log-prob computation.
  m.logprob_chunk = 128
  # Seed of the random init.
  m.init_seed = 0
  return m


def data_section() -> ml_collections.ConfigDict:
  """Prompts: the embedded arithmetic task or a local JSONL/Parquet file."""
  d = ml_collections.ConfigDict()
  # 'arithmetic' (generated, no files), 'jsonl' or 'parquet'.
  d.source = 'arithmetic'
  # jsonl/parquet: the training file.
  d.path = ''
  # jsonl/parquet: a held-out file for evaluation ('' takes eval prompts
  # from the end of a generated task, or none for files).
  d.eval_path = ''
  # jsonl/parquet: the prompt and answer fields (GSM8K: question, answer).
  d.prompt_field = 'question'
  d.answer_field = 'answer'
  # 'gsm8k' (the answer after '####') or 'raw'.
  d.answer_format = 'gsm8k'
  # Text around the prompt; must contain '{prompt}'.
  d.prompt_template = '{prompt}'
  # Shuffle every epoch (deterministic from train.seed and the epoch).
  d.shuffle = True
  # arithmetic: training examples, their seed, operand range and operators.
  d.num_examples = 100_000
  d.seed = 0
  d.max_operand = 99
  d.ops = '+'
  # arithmetic: held-out evaluation examples (drawn with seed + 1).
  d.eval_examples = 256
  return d


def rollout_section() -> ml_collections.ConfigDict:
  """Sampling with the JetStream engine, sync or async."""
  r = ml_collections.ConfigDict()
  # Prompts per RL step and samples per prompt (the GRPO group size); the
  # batch is prompts_per_step * samples_per_prompt sequences.
  r.prompts_per_step = 16
  r.samples_per_prompt = 8
  # Longest prompt in tokens (longer prompts are an error) and response cap.
  r.max_prompt_length = 32
  r.max_new_tokens = 16
  # Sampling; the trainer scores with the same temperature (contract §1).
  r.temperature = 1.0
  r.top_k = 0
  r.top_p = 1.0
  r.min_p = 0.0
  # μ for the correction: 'full' (verl) or 'truncated' (contract §2).
  r.logprob_mode = 'full'
  # Engine decode slots.
  r.max_concurrent_decodes = 64
  # Engine decode steps per device dispatch: the host reads tokens and
  # refills freed slots between dispatches (docs/rollout.md).
  r.decode_chunk = 32
  # Engine parameter/compute dtype ('float32', 'bfloat16'): a bf16 engine is
  # the usual training/inference mismatch.
  r.engine_dtype = 'float32'
  # Engine weight quantisation: 'none' or 'int8' (per-row symmetric int8,
  # dequantised: a stronger, controlled mismatch for experiments).
  r.engine_quant = 'none'
  # 'sync' (rollout with the current weights, then train) or 'async'
  # (a producer thread on its own devices, bounded staleness).
  r.mode = 'sync'
  # async: devices of the rollout sub-mesh (the rest train); 0 shares the
  # trainer's devices.
  r.rollout_devices = 0
  # async: batches waiting in the queue.
  r.queue_size = 1
  # Rows older than this many policy versions are dropped (contract §6);
  # async mode also never samples further ahead. None: unlimited (sync).
  r.max_staleness = config_dict.placeholder(int)
  # Non-finite rollout log-probs go to the in-graph rejection (True) or fail
  # host validation (False).
  r.allow_nonfinite_logp = False
  # Largest tolerated fraction of ERROR rows before the loop raises.
  r.max_error_fraction = 0.0
  return r


def reward_section() -> ml_collections.ConfigDict:
  """Reward functions of `jaxcorr.train.reward_fns`, by name."""
  w = ml_collections.ConfigDict()
  # 'name:weight,name:weight' (weight 1 when omitted): exact_match,
  # math_answer, format, arith_exact, or any registered name.
  w.functions = 'exact_match'
  # Seconds per call; a call that takes longer scores 0 (metric
  # reward/timeouts). 0: no timeout, call inline.
  w.timeout_s = 5.0
  return w


def train_section() -> ml_collections.ConfigDict:
  """Steps, batch geometry, evaluation, checkpoints and logging."""
  t = ml_collections.ConfigDict()
  # RL steps (one rollout batch each).
  t.num_steps = 100
  # Supervised warm-up steps (cross-entropy on prompt -> answer) before RL.
  t.sft_steps = 0
  # Sequences per SFT step.
  t.sft_batch_size = 64
  # Passes over each rollout batch.
  t.ppo_epochs = 1
  # Optimizer updates per epoch (the batch is split into this many).
  t.mini_batches = 1
  # Gradient-accumulation chunks per mini-batch (global normalisers).
  t.micro_batches = 1
  # Shuffle rows before splitting into mini-batches (PRNG from train.seed).
  t.shuffle_minibatches = True
  # Save every N RL steps (0: only at the end and on SIGTERM), keep K.
  t.checkpoint_every = 50
  t.keep_checkpoints = 3
  # Greedy evaluation on held-out prompts every N RL steps (0: never);
  # also before the first RL step and at the end.
  t.eval_every = 10
  # Held-out prompts per evaluation.
  t.eval_prompts = 128
  # Root seed: init, data order, sampling, mini-batch shuffles.
  t.seed = 0
  # TensorBoard event files next to metrics.jsonl.
  t.tensorboard = True
  # Console progress line every N steps.
  t.log_every = 1
  return t


def optim_section() -> ml_collections.ConfigDict:
  """optax AdamW with warmup + cosine decay and global-norm clipping."""
  o = ml_collections.ConfigDict()
  # Peak learning rate of the RL phase.
  o.learning_rate = 1e-6
  # Peak learning rate of the SFT warm-up (its own schedule and moments).
  o.sft_learning_rate = 1e-3
  # Linear warmup steps (optimizer updates), then the schedule.
  o.warmup_steps = 0
  # 'constant' or 'cosine' (to min_lr_ratio * peak at the last update).
  o.schedule = 'constant'
  o.min_lr_ratio = 0.1
  # AdamW's decoupled weight decay, moment decays and epsilon.
  o.weight_decay = 0.0
  o.b1 = 0.9
  o.b2 = 0.999
  o.eps = 1e-8
  # Global-norm gradient clipping (0: off).
  o.max_grad_norm = 1.0
  return o


def critic_section() -> ml_collections.ConfigDict:
  """The value model for GAE (a copy of the policy with a scalar head)."""
  c = ml_collections.ConfigDict()
  # Train a critic; required by algorithm.estimator='gae'.
  c.enabled = False
  c.learning_rate = 1e-5
  # Value clipping ε of the clipped value loss.
  c.cliprange_value = 0.5
  # Aggregation of the value loss (a token/seq mode of aggregate).
  c.agg = 'token_mean'
  return c


def mesh_section() -> ml_collections.ConfigDict:
  """Trainer mesh axis sizes; one may be -1 (all remaining devices)."""
  s = ml_collections.ConfigDict()
  # Pure data parallelism (params replicated along it).
  s.data = 1
  # Data parallelism with params and optimizer state sharded (ZeRO-3).
  s.fsdp = -1
  # Tensor (model) parallelism over heads and the MLP width.
  s.tensor = 1
  return s
