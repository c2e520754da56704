"""Serve the policy with JetStream's own gRPC server.

    python -m jaxcorr.serve --checkpoint DIR [--port 9000] [--slots 8]
    python -m jaxcorr.serve --random-tiny            # a tiny random model

A trained checkpoint (HF layout, `jaxcorr.model.load_hf`) goes behind a
`PolicyEngine` and JetStream's orchestrator (`jetstream.core.server_lib`),
so JetStream's client (`jetstream_pb2_grpc.OrchestratorStub.Decode`)
queries it. Text prompts are whitespace-separated token ids (`IdTokenizer`)
unless the engine is given a real tokenizer. JetStream 0.2.2 streams text
only: log-probs are for the offline driver (`jaxcorr.rollout.driver`).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import jax
from flax import nnx

from jaxcorr.rollout.engine import PolicyEngine, SamplingParams


def start_server(
  engine: PolicyEngine, port: int, *, threads: int | None = None
) -> Any:
  """Start JetStream's gRPC server on localhost:`port` serving `engine`
  (interleaved prefill and generate on the engine's devices); returns its
  `JetStreamServer` (`.stop()`)."""
  # Imported here, and root logging restored after: JetStream's orchestrator
  # sets the root logger to DEBUG with its own stdout handler on import.
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from jetstream.core import config_lib, server_lib

  root.setLevel(level)
  root.handlers[:] = handlers

  # JetStream 0.2.2's orchestrator still calls `jax.tree_map`, which JAX
  # removed; alias the public replacement so its threads do not die.
  if not hasattr(jax, 'tree_map'):
    jax.tree_map = jax.tree.map
  devices = list(engine.mesh.devices.flat) if engine.mesh else jax.devices()[:1]
  config = config_lib.ServerConfig(
    interleaved_slices=(f'cpu={len(devices)}',),
    interleaved_engine_create_fns=(lambda _devices: engine,),
  )
  return server_lib.run(
    port=port,
    config=config,
    devices=devices,
    threads=threads or max(4, engine.max_concurrent_decodes),
    jax_padding=False,
  )


def _tiny_model():
  from jaxcorr.model import Transformer, TransformerConfig

  cfg = TransformerConfig(
    architecture='Qwen2ForCausalLM',
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
  )
  return Transformer(cfg, rngs=nnx.Rngs(0))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  src = parser.add_mutually_exclusive_group(required=True)
  src.add_argument('--checkpoint', help='HF-layout checkpoint directory')
  src.add_argument('--random-tiny', action='store_true')
  parser.add_argument('--port', type=int, default=9000)
  parser.add_argument('--slots', type=int, default=8)
  parser.add_argument('--max-prefill-length', type=int, default=256)
  parser.add_argument('--max-target-length', type=int, default=1024)
  parser.add_argument('--dtype', default=None, help='e.g. bfloat16')
  parser.add_argument('--temperature', type=float, default=1.0)
  parser.add_argument('--top-k', type=int, default=0)
  parser.add_argument('--top-p', type=float, default=1.0)
  args = parser.parse_args(argv)
  if args.random_tiny:
    model = _tiny_model()
  else:
    from jaxcorr.model import load_hf

    model = load_hf(args.checkpoint)
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=args.slots,
    max_prefill_length=args.max_prefill_length,
    max_target_length=args.max_target_length,
    dtype=args.dtype,
    default_sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
  )
  server = start_server(engine, args.port)
  print(f'jaxcorr: JetStream server on localhost:{args.port}', flush=True)
  server.wait_for_termination()


if __name__ == '__main__':
  main()
