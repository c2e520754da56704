"""The HTTP server: FastAPI routes on uvicorn, in a thread of the trainer.

    POST /s/<session>/v1/chat/completions     the session in the path: an
    POST /s/<session>/v1/completions          agent's base_url is
    GET  /s/<session>/v1/models               http://host:port/s/<session>/v1
    POST /v1/chat/completions, /v1/completions     the session is the API key
                                                   (Authorization: Bearer)

Why FastAPI + uvicorn: both were already installed with the project's
dependencies (no new server dependency), uvicorn is the ASGI server the
OpenAI-compatible servers of vLLM and SGLang run on, and an async handler
waits for its turn without holding a thread (hundreds of agents may wait
on the engine at once). Every failure is an OpenAI error object with its
status: a body that is not JSON or not a valid request (400), an unknown
session (404) or an ended one (409), an unknown route (404) or method
(405), and anything unexpected (500); the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from jaxcorr.endpoint.protocol import (
  MODEL,
  ApiError,
  chat_request,
  completion_request,
  stream_events,
)
from jaxcorr.endpoint.sessions import Call, SessionHub

PARSERS = {'chat': chat_request, 'completion': completion_request}


def _session_of(request: Any) -> str:
  auth = request.headers.get('authorization', '')
  if not auth.lower().startswith('bearer ') or not auth[7:].strip():
    raise ApiError(
      401,
      'no session: use base_url http://host:port/s/<session>/v1 or the '
      'session as the API key',
      kind='authentication_error',
      code='invalid_api_key',
    )
  return auth[7:].strip()


def build_app(hub: SessionHub):
  """The FastAPI application over `hub`'s sessions."""
  app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

  def error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)

  @app.exception_handler(ApiError)
  async def api_error(request, err: ApiError):
    return error(err)

  @app.exception_handler(HTTPException)
  async def http_error(request, err: HTTPException):
    kind = 'not_found_error' if err.status_code == 404 else 'invalid_request'
    return error(ApiError(err.status_code, str(err.detail), kind=kind))

  @app.exception_handler(Exception)
  async def server_error(request, err: Exception):
    return error(ApiError(500, f'{type(err).__name__}: {err}', kind='server'))

  async def serve(kind: str, session_id: str, request: Request):
    try:
      body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as err:
      raise ApiError(400, f'the body is not JSON: {err}') from None
    checked = PARSERS[kind](body)
    session = hub.get(session_id)
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def reply(status: int, payload: dict[str, Any]) -> None:
      def settle():
        if not done.done():
          done.set_result((status, payload))

      loop.call_soon_threadsafe(settle)

    session.submit(Call(kind, checked, reply))
    status, payload = await done
    if checked.stream and status == 200:
      events = stream_events(payload)
      return StreamingResponse(iter(events), media_type='text/event-stream')
    return JSONResponse(payload, status_code=status)

  models = {'object': 'list', 'data': [{'id': MODEL, 'object': 'model'}]}

  @app.post('/s/{session}/v1/chat/completions')
  async def chat(session: str, request: Request):
    return await serve('chat', session, request)

  @app.post('/s/{session}/v1/completions')
  async def completions(session: str, request: Request):
    return await serve('completion', session, request)

  @app.get('/s/{session}/v1/models')
  async def session_models(session: str):
    return models

  @app.post('/v1/chat/completions')
  async def chat_by_key(request: Request):
    return await serve('chat', _session_of(request), request)

  @app.post('/v1/completions')
  async def completions_by_key(request: Request):
    return await serve('completion', _session_of(request), request)

  @app.get('/v1/models')
  async def key_models():
    return models

  return app


class ThreadedServer:
  """An ASGI app on a uvicorn server in a daemon thread (`host`, `port`;
  port 0: a free one, read back as `.port`); uvicorn logs at `log_level`."""

  def __init__(
    self,
    app: Any,
    host: str = '127.0.0.1',
    port: int = 0,
    log_level: str = 'warning',
  ):
    config = uvicorn.Config(
      app,
      host=host,
      port=port,
      log_level=log_level,
      access_log=False,
      lifespan='off',
    )
    self._server = uvicorn.Server(config)
    self._thread = threading.Thread(
      target=self._server.run, name='jaxcorr-http', daemon=True
    )
    self._thread.start()
    deadline = time.monotonic() + 30
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f'could not listen on {host}:{port}')
      time.sleep(0.01)
    self.host = host
    self.port = self._server.servers[0].sockets[0].getsockname()[1]

  @property
  def url(self) -> str:
    return f'http://{self.host}:{self.port}'

  def close(self) -> None:
    self._server.should_exit = True
    self._thread.join(timeout=5)


class EndpointServer(ThreadedServer):
  """The endpoint's app over a fresh `SessionHub` (`.hub`)."""

  def __init__(self, host: str = '127.0.0.1', port: int = 0):
    self.hub = SessionHub()
    super().__init__(build_app(self.hub), host, port)

  def base_url(self, session: str) -> str:
    return f'{self.url}/s/{session}/v1'


_SERVERS: dict[tuple[str, int], EndpointServer] = {}
_LOCK = threading.Lock()


def shared_server(host: str, port: int) -> EndpointServer:
  """One server per (host, port) in a process, started on first use (every
  agent environment of a run shares it)."""
  with _LOCK:
    if (host, port) not in _SERVERS:
      _SERVERS[host, port] = EndpointServer(host, port)
    return _SERVERS[host, port]
