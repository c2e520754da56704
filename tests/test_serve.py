"""`jaxcorr.serve`: JetStream's gRPC server over a `PolicyEngine`, queried
with JetStream's own client on localhost."""

import re
import socket

import grpc
import jax.numpy as jnp
import pytest
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from jaxcorr.rollout.engine import PolicyEngine, SamplingParams
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


def _serve_bad_requests(decode_after: bool) -> list[int]:
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
        return []
      return [
        t
        for response in stub.Decode(_text('5 6 7', max_tokens=3), timeout=120)
        for sample in response.stream_content.samples
        for t in sample.token_ids
      ]
  finally:
    server.stop()


def test_bad_requests_get_an_error_and_the_server_stays_up():
  """Each bad request fails its own RPC with the reason (before, one bad
  request killed the server from JetStream's prefill thread)."""
  _serve_bad_requests(decode_after=False)


@pytest.mark.slow
def test_server_decodes_after_bad_requests():
  streamed = _serve_bad_requests(decode_after=True)
  assert streamed and all(0 <= t < 128 for t in streamed)


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
