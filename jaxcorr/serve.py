"""Serve the policy with JetStream's gRPC orchestrator service.

    python -m jaxcorr.serve --checkpoint DIR [--port 9000] [--slots 8]
    python -m jaxcorr.serve --random-tiny            # a tiny random model
    python -m jaxcorr.serve --random-tiny --host 0.0.0.0   # all interfaces

A trained checkpoint (HF layout, `jaxcorr.model.load_hf`) goes behind a
`PolicyEngine` and JetStream's orchestrator (`jetstream.core.server_lib`),
so JetStream's client (`jetstream_pb2_grpc.OrchestratorStub.Decode`)
queries it. Text prompts are whitespace-separated token ids (`IdTokenizer`)
unless the engine is given a real tokenizer; each streamed piece of a text
response is ' <id>', so joined pieces are whitespace-separated ids too.
JetStream 0.2.2 streams text only: log-probs are for the offline driver
(`jaxcorr.rollout.driver`).

Binding: the server listens on `--host` (default `localhost`, the loopback
interface only) and the port it prints, and nowhere else. The channel has
no authentication or encryption (gRPC insecure credentials), so a wider
`--host` (`0.0.0.0`, `::`, an interface address) lets anyone who reaches it
use the model, and is warned about. A port another process listens on is
refused (`PortInUse`): the server binds without SO_REUSEPORT, which gRPC
sets by default and with which a second server on the same port would
start and silently take half the connections. (JetStream's own
`server_lib.JetStreamServer` binds `[::]` with it; `PolicyServer` is that
server with the address and the option under our control.)
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import socket
import threading
from concurrent import futures
from typing import Any

import grpc
import jax
import numpy as np
from flax import nnx

from jaxcorr.rollout.engine import PolicyEngine
from jaxcorr.rollout.state import SamplingParams

_LOOPBACK = ('localhost', '127.0.0.1', '::1')


class PortInUse(OSError):
  """Another process listens on the address the server would bind."""


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


def is_loopback(host: str) -> bool:
  """Whether `host` names the loopback interface only."""
  return host.strip('[]') in _LOOPBACK or host.startswith('127.')


def check_port_free(host: str, port: int) -> None:
  """Raises `PortInUse` when a socket listens on `port` at any address
  `host` resolves to. gRPC binds each address it can and skips the others,
  so without this a server on 127.0.0.1 only would leave ours on ::1."""
  infos = socket.getaddrinfo(
    host.strip('[]'), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
  )
  for family, kind, proto, _, address in infos:
    with socket.socket(family, kind, proto) as s:
      # As gRPC does: a connection in TIME_WAIT is no listener.
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        s.bind(address)
      except OSError as e:
        if e.errno == errno.EADDRINUSE:
          raise PortInUse(
            f'port {port} on {host} ({address[0]}) is in use by another '
            'process (another server?); stop it or choose another --port'
          ) from None
        # EADDRNOTAVAIL (no IPv6 loopback, say): gRPC skips it too.


class PolicyServer:
  """JetStream's `LLMOrchestrator` gRPC service over `driver` on
  `host:port` (0: a free port, see `.port`), without port sharing; the
  interface of JetStream's `JetStreamServer` (module doc)."""

  def __init__(self, driver: Any, threads: int, host: str, port: int):
    from jetstream.core import orchestrator
    from jetstream.core.proto import jetstream_pb2_grpc

    if port:
      check_port_free(host, port)
    self._driver = driver
    self._executor = futures.ThreadPoolExecutor(max_workers=threads)
    self._loop = asyncio.new_event_loop()
    self._loop.set_default_executor(self._executor)
    self._thread = threading.Thread(
      target=self._loop.run_forever, name='jaxcorr-serve', daemon=True
    )
    self._thread.start()

    async def build():
      server = grpc.aio.server(
        self._executor, options=[('grpc.so_reuseport', 0)]
      )
      jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
        orchestrator.LLMOrchestrator(driver=driver), server
      )
      target = f'[{host}]' if ':' in host and '[' not in host else host
      try:
        bound = server.add_insecure_port(f'{target}:{port}')
      except RuntimeError:  # lost a race for the port since the check
        raise PortInUse(
          f'port {port} on {host} is in use by another process; choose '
          'another --port'
        ) from None
      return server, bound

    try:
      self._server, self.port = self._run(build())
    except BaseException:
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join()
      self._executor.shutdown(wait=False)
      raise
    self.host = host

  def _run(self, coroutine) -> Any:
    return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

  def start(self) -> None:
    self._run(self._server.start())

  def stop(self) -> None:
    """Stops the driver's threads, then the server (10 s grace)."""
    self._driver.stop()
    self._run(self._server.stop(grace=10))
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join()

  def wait_for_termination(self) -> None:
    try:
      self._run(self._server.wait_for_termination())
    finally:
      self.stop()


def start_server(
  engine: PolicyEngine,
  port: int,
  *,
  host: str = 'localhost',
  threads: int | None = None,
) -> PolicyServer:
  """Start JetStream's gRPC service on `host:port` serving `engine`
  (interleaved prefill and generate on the engine's devices); returns the
  `PolicyServer` (`.port`, `.stop()`). `PortInUse` when another process
  listens there (module doc).

  Requests are checked (`check_request`) before they reach the engine: a
  bad one fails its own RPC with the reason in the status details, and the
  server keeps serving. (Unchecked, the exception would be raised in
  JetStream's prefill thread, which kills the whole process.)"""
  # Imported here, and root logging restored after: JetStream's orchestrator
  # sets the root logger to DEBUG with its own stdout handler on import.
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  from jetstream.core import orchestrator

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

  # What JetStream's `server_lib.run` does for one interleaved engine, with
  # the checking driver and our server.
  params = engine.load_params()
  driver = CheckedDriver(
    prefill_engines=[engine],
    generate_engines=[engine],
    prefill_params=[params],
    generate_params=[params],
    interleaved_mode=True,
    jax_padding=False,
  )
  try:
    server = PolicyServer(
      driver, threads or max(4, engine.max_concurrent_decodes), host, port
    )
  except BaseException:
    driver.stop()
    raise
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
  parser.add_argument(
    '--host',
    default='localhost',
    help='address to listen on (default: loopback only; the channel is '
    'unauthenticated)',
  )
  parser.add_argument('--slots', type=int, default=8)
  parser.add_argument('--max-prefill-length', type=int, default=256)
  parser.add_argument('--max-target-length', type=int, default=1024)
  parser.add_argument('--dtype', default=None, help='e.g. bfloat16')
  parser.add_argument('--temperature', type=float, default=1.0)
  parser.add_argument('--top-k', type=int, default=0)
  parser.add_argument('--top-p', type=float, default=1.0)
  args = parser.parse_args(argv)
  try:
    check_port_free(args.host, args.port)
  except (PortInUse, socket.gaierror) as e:
    parser.exit(1, f'jaxcorr.serve: {e}\n')
  if not is_loopback(args.host):
    logging.warning(
      'jaxcorr.serve: listening on %s:%d beyond this machine; the gRPC '
      'channel is unauthenticated and unencrypted: anyone who can reach it '
      'can use the model',
      args.host,
      args.port,
    )
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
  try:
    server = start_server(engine, args.port, host=args.host)
  except PortInUse as e:
    parser.exit(1, f'jaxcorr.serve: {e}\n')
  print(f'jaxcorr: JetStream server on {args.host}:{server.port}', flush=True)
  server.wait_for_termination()


if __name__ == '__main__':
  main()
