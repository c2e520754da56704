"""`jaxcorr.serve`: JetStream's gRPC server over a `PolicyEngine`, queried
with JetStream's own client on localhost."""

import os
import re
import socket
import subprocess
import sys
import time

import grpc
import jax.numpy as jnp
import pytest
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from jaxcorr import serve
from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
from jaxcorr.rollout.tokenizer import IdTokenizer
from jaxcorr.serve import InvalidRequest, check_request, start_server
from tests.helpers.model_testing import forward, random_model, tiny_config


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_server_decodes_a_prompt_greedily():
  model = random_model(tiny_config())
  engine = PolicyEngine(
    model,
    max_concurrent_decodes=2,
    max_prefill_length=16,
    max_target_length=32,
    default_sampling=SamplingParams(top_k=1),
  )
  port = _free_port()
  server = start_server(engine, port)
  try:
    with grpc.insecure_channel(f'localhost:{port}') as channel:
      grpc.channel_ready_future(channel).result(timeout=60)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      request = jetstream_pb2.DecodeRequest(
        max_tokens=6,
        token_content=jetstream_pb2.DecodeRequest.TokenContent(
          token_ids=[5, 6, 7]
        ),
      )
      streamed = []
      for response in stub.Decode(request, timeout=120):
        for sample in response.stream_content.samples:
          streamed.extend(sample.token_ids)
  finally:
    server.stop()
  assert streamed
  # Greedy reference; the orchestrator prepends BOS (is_bos=True).
  seq = [1, 5, 6, 7]
  for _ in range(8):
    padded = jnp.asarray([seq + [0] * (32 - len(seq))])
    seq.append(int(jnp.argmax(forward(model, padded)[0, len(seq) - 1])))
  ref = seq[4:]
  # JetStream 0.2.2 streams generate() outputs only: the token sampled at
  # prefill is not sent, the stream starts at the second response token.
  assert len(streamed) >= 4
  assert streamed == ref[1 : 1 + len(streamed)], (streamed, ref)


def _engine():
  return PolicyEngine(
    random_model(tiny_config()),
    max_concurrent_decodes=2,
    max_prefill_length=16,
    max_target_length=32,
    default_sampling=SamplingParams(top_k=1),
  )


def _tokens(ids, max_tokens=4):
  return jetstream_pb2.DecodeRequest(
    max_tokens=max_tokens,
    token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids),
  )


def _text(text, max_tokens=4):
  return jetstream_pb2.DecodeRequest(
    max_tokens=max_tokens,
    text_content=jetstream_pb2.DecodeRequest.TextContent(text=text),
  )


BAD_REQUESTS = [
  (_text('hello world'), 'whitespace-separated token ids'),
  (_text('5 999'), r'\[0, 128\)'),
  (_tokens([5, 128]), r'token id 128 is outside the vocabulary \[0, 128\)'),
  (_text('5 -1'), r'\[0, 128\)'),
  (_tokens(list(range(16))), r'17 tokens .* --max-prefill-length=16'),
  (_tokens([5], max_tokens=0), r'max_tokens=0: allowed 1\.\.30'),
  (_tokens([5], max_tokens=31), r'max_tokens=31: allowed 1\.\.30'),
]


def _serve_bad_requests(decode_after: bool) -> tuple[list[int], str]:
  engine = _engine()
  port = _free_port()
  server = start_server(engine, port)
  try:
    with grpc.insecure_channel(f'localhost:{port}') as channel:
      grpc.channel_ready_future(channel).result(timeout=60)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      for request, reason in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError) as info:
          list(stub.Decode(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.UNKNOWN
        assert re.search(reason, info.value.details()), info.value.details()
      health = stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=60)
      assert health.is_live
      if not decode_after:
        return [], ''
      ids, text = [], ''
      for response in stub.Decode(_text('5 6 7', max_tokens=3), timeout=120):
        for sample in response.stream_content.samples:
          ids.extend(sample.token_ids)
          text += sample.text  # as JetStream's clients join the pieces
      return ids, text
  finally:
    server.stop()


def test_bad_requests_get_an_error_and_the_server_stays_up():
  """Each bad request fails its own RPC with the reason (before, one bad
  request killed the server from JetStream's prefill thread)."""
  _serve_bad_requests(decode_after=False)


@pytest.mark.slow
def test_server_decodes_after_bad_requests():
  streamed, text = _serve_bad_requests(decode_after=True)
  assert streamed and all(0 <= t < 128 for t in streamed)
  # One piece per id, joined: still the ids, separated.
  assert text.split() == [str(t) for t in streamed], (text, streamed)


def test_check_request_accepts_the_limits():
  from jetstream.core.orchestrator import ActiveRequest

  engine = _engine()

  def active(content, max_tokens, history=''):
    return ActiveRequest(
      max_tokens=max_tokens,
      prefill_content=content,
      history_path=history,
      return_channel=None,
    )

  check_request(engine, active(list(range(15)), 16))  # 16 with BOS, 16 left
  check_request(engine, active('1 2 3', 1))
  check_request(engine, active(list(range(16)), 1, history='s'))  # no BOS
  with pytest.raises(InvalidRequest, match='empty prompt'):
    check_request(engine, active([], 1, history='s'))
  with pytest.raises(InvalidRequest, match=r'max_tokens=17: allowed 1\.\.16'):
    check_request(engine, active(list(range(15)), 17))


def test_id_text_pieces_join_into_separated_ids():
  """The server decodes and streams one id per piece; a client joining the
  pieces used to get '567' for [5, 6, 7]."""
  tok = IdTokenizer(128)
  ids = [5, 6, 17, 0]
  pieces = [tok.decode([t]) for t in ids]
  assert ''.join(pieces) == tok.decode(ids) == ' 5 6 17 0'
  joined, n = tok.encode(''.join(pieces))
  assert n == 4 and joined.tolist() == ids
  # The prompt's text followed by the response's: the whole sequence.
  assert tok.encode('1 2' + tok.decode(ids))[0].tolist() == [1, 2, *ids]


def _listening(port: int) -> set[str]:
  """Local addresses of TCP sockets listening on `port` (Linux /proc)."""
  out = set()
  for name, family in (('tcp', socket.AF_INET), ('tcp6', socket.AF_INET6)):
    try:
      with open(f'/proc/net/{name}') as f:
        rows = f.read().splitlines()[1:]
    except OSError:
      continue
    for row in rows:
      local, state = row.split()[1], row.split()[3]
      address, hex_port = local.split(':')
      if state != '0A' or int(hex_port, 16) != port:
        continue
      raw = bytes.fromhex(address)
      # /proc prints each 32-bit word in host (little-endian) order.
      raw = b''.join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
      out.add(socket.inet_ntop(family, raw))
  return out


def test_server_binds_loopback_and_refuses_a_port_in_use():
  """It printed localhost:P but listened on [::] (every interface), with
  SO_REUSEPORT, so a second server on P started too and took half the
  clients. Now: loopback only by default, and a used port is refused."""
  port = _free_port()
  server = start_server(_engine(), port)
  try:
    assert server.port == port
    if os.path.exists('/proc/net/tcp'):
      bound = _listening(port)
      assert bound and bound <= {'127.0.0.1', '::1', '::ffff:127.0.0.1'}, bound
    for host in ('localhost', '127.0.0.1'):
      with pytest.raises(serve.PortInUse, match=f'port {port} on {host}'):
        start_server(_engine(), port, host=host)
    with grpc.insecure_channel(f'localhost:{port}') as channel:
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      health = stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=60)
      assert health.is_live  # the first server is unharmed
  finally:
    server.stop()
  # A listener on 127.0.0.1 alone: gRPC alone would bind ::1 and start.
  with socket.socket() as other:
    other.bind(('127.0.0.1', 0))
    other.listen()
    with pytest.raises(serve.PortInUse):
      start_server(_engine(), other.getsockname()[1])
  assert serve.is_loopback('localhost') and serve.is_loopback('127.0.0.2')
  assert serve.is_loopback('[::1]') and not serve.is_loopback('0.0.0.0')
  assert not serve.is_loopback('::')


def test_cli_refuses_a_port_in_use(capsys):
  with socket.socket() as other:
    other.bind(('127.0.0.1', 0))
    other.listen()
    port = other.getsockname()[1]
    with pytest.raises(SystemExit) as exit_:
      serve.main(['--random-tiny', f'--port={port}'])
  assert exit_.value.code == 1
  err = capsys.readouterr().err
  assert f'jaxcorr.serve: port {port} on localhost' in err and 'in use' in err


@pytest.mark.slow
def test_two_servers_on_one_port():
  """`python -m jaxcorr.serve --port=P` twice: the second exits 1 with one
  line; the first serves on, at the address it printed."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  port = _free_port()
  cmd = [
    sys.executable,
    '-m',
    'jaxcorr.serve',
    '--random-tiny',
    f'--port={port}',
  ]
  first = subprocess.Popen(
    cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
  )
  try:
    line = first.stdout.readline()
    assert line.strip() == f'jaxcorr: JetStream server on localhost:{port}'
    start = time.monotonic()
    second = subprocess.run(
      cmd, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 1, second.stdout
    assert 'is in use by another process' in second.stderr.splitlines()[-1]
    assert time.monotonic() - start < 120
    with grpc.insecure_channel(f'localhost:{port}') as channel:
      grpc.channel_ready_future(channel).result(timeout=60)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      health = stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=60)
      assert health.is_live
  finally:
    first.kill()
    first.wait()
