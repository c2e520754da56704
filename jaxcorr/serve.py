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

import grpc
import jax
import numpy as np
from flax import nnx

from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams


class InvalidRequest(ValueError):
  """A `DecodeRequest` the engine cannot serve (`check_request`)."""


def check_request(engine: PolicyEngine, request: Any) -> None:
  """Raises `InvalidRequest` for a JetStream `ActiveRequest` the engine
  cannot serve: text that its tokenizer rejects (for `IdTokenizer`: not
  whitespace-separated ids, or an id outside the vocabulary), token ids
  outside `[0, vocab_size)`, an empty prompt, a prompt longer than
  `max_prefill_length` once BOS is added, or `max_tokens` < 1 or past
  `max_target_length`."""
  content = request.prefill_content
  tokenizer = engine.build_tokenizer(engine.get_tokenizer())
  vocab = engine.config.vocab_size
  if isinstance(content, str):
    try:
      ids, n = tokenizer.encode(content)
    except Exception as e:  # the tokenizer's own message
      raise InvalidRequest(f'text_content: {e}') from None
    ids = np.asarray(ids).reshape(-1)[:n]
  else:
    ids = np.asarray(list(content), np.int64)
  if ids.size and (ids.min() < 0 or ids.max() >= vocab):
    bad = ids[(ids < 0) | (ids >= vocab)][0]
    raise InvalidRequest(
      f'token id {int(bad)} is outside the vocabulary [0, {vocab})'
    )
  # The orchestrator prepends BOS unless the request continues a session.
  n = int(ids.size) + (0 if request.history_path else 1)
  if n < 1:
    raise InvalidRequest('empty prompt')
  if n > engine.max_prefill_length:
    raise InvalidRequest(
      f"the prompt has {n} tokens (BOS included) > the server's "
      f'--max-prefill-length={engine.max_prefill_length}'
    )
  room = engine.max_target_length - n
  if not 1 <= request.max_tokens <= room:
    raise InvalidRequest(
      f"max_tokens={request.max_tokens}: allowed 1..{room} (the server's "
      f'--max-target-length={engine.max_target_length} minus the prompt)'
    )


def start_server(
  engine: PolicyEngine, port: int, *, threads: int | None = None
) -> Any:
  """Start JetStream's gRPC server on localhost:`port` serving `engine`
  (interleaved prefill and generate on the engine's devices); returns its
  `JetStreamServer` (`.stop()`).

  Requests are checked (`check_request`) before they reach the engine: a
  bad one fails its own RPC with the reason in the status details, and the
  server keeps serving. (Unchecked, the exception would be raised in
  JetStream's prefill thread, which kills the whole process.)"""
  # Imported here, and root logging restored after: JetStream's orchestrator
  # sets the root logger to DEBUG with its own stdout handler on import.
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from jetstream.core import orchestrator, server_lib

  root.setLevel(level)
  root.handlers[:] = handlers

  # JetStream 0.2.2's orchestrator still calls `jax.tree_map`, which JAX
  # removed; alias the public replacement so its threads do not die.
  if not hasattr(jax, 'tree_map'):
    jax.tree_map = jax.tree.map

  class CheckedDriver(orchestrator.Driver):
    """JetStream's driver with `check_request` at its entrance (the gRPC
    handler reports the exception as the RPC's error)."""

    def place_request_on_prefill_queue(self, request):
      check_request(engine, request)
      super().place_request_on_prefill_queue(request)

  # What `server_lib.run` does for one interleaved engine, with the
  # checking driver.
  params = engine.load_params()
  driver = CheckedDriver(
    prefill_engines=[engine],
    generate_engines=[engine],
    prefill_params=[params],
    generate_params=[params],
    interleaved_mode=True,
    jax_padding=False,
  )
  server = server_lib.JetStreamServer(
    driver,
    threads or max(4, engine.max_concurrent_decodes),
    port,
    grpc.insecure_server_credentials(),
  )
  server.start()
  return server


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
