"""The endpoint as an OpenAI-compatible HTTP API: in process (an ASGI app) or on a local port.

:class:`EpisodeRoutes` is an ASGI app that serves each open episode under a path of its own::

    POST /e/{key}/v1/chat/completions      PolicyEndpoint.chat_completion
    POST /e/{key}/v1/completions           PolicyEndpoint.completion
    GET  /e/{key}/v1/models                the one model name

so a client's ``base_url`` names its episode (``{root}/e/{key}/v1``) and the app's code needs
nothing else. :func:`openai_client` gives an ``openai.AsyncOpenAI`` whose requests go straight
into the ASGI app (``httpx.ASGITransport``: no socket); :class:`LocalServer` serves the same app on
``127.0.0.1`` for apps in other processes (uvicorn; its signal handling and logging setup are left
off: the command's own stay in charge). A refused request is an OpenAI-style error body with
HTTP 400; any other failure answers 500, and both are kept on the episode, which the stage then
fails with.
"""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from thundersync.agents.endpoint import PolicyEndpoint
from thundersync.agents.episode import EpisodeRecorder
from thundersync.errors import AgentAppError, MissingExtraError

__all__ = ["MAX_BODY_BYTES", "EpisodeRoutes", "LocalServer", "openai_client"]

MAX_BODY_BYTES = 64 * 2**20
"""The largest request body the routes read (a longer one is refused with HTTP 413)."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class EpisodeRoutes:
    """An ASGI app that routes each open episode's requests to ``endpoint`` (module docstring)."""

    def __init__(self, endpoint: PolicyEndpoint) -> None:
        self.endpoint = endpoint
        self._episodes: dict[str, EpisodeRecorder] = {}

    def open(self, episode: EpisodeRecorder) -> str:
        """Serve ``episode``; returns its key (the path ``/e/{key}/v1``)."""
        key = secrets.token_urlsafe(12)
        self._episodes[key] = episode
        return key

    def close(self, key: str) -> None:
        """Stop serving the episode of ``key`` (later requests get 404)."""
        episode = self._episodes.pop(key, None)
        if episode is not None:
            self.endpoint.forget(episode)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["type"] != "http":
            raise AgentAppError(f"the agent endpoint serves HTTP only, not {scope['type']}", status=500)
        status, payload = await self._answer(scope, receive)
        body = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _answer(self, scope: Scope, receive: Receive) -> tuple[int, dict[str, Any]]:
        parts = str(scope.get("path", "")).strip("/").split("/")
        if len(parts) < 4 or parts[0] != "e" or parts[2] != "v1":
            return _error(404, f"no route {scope.get('path')!r}; clients use base_url {{root}}/e/{{key}}/v1")
        episode = self._episodes.get(parts[1])
        if episode is None:
            return _error(404, "no open episode has this key (it ended, or the key is wrong)")
        route, method = "/".join(parts[3:]), scope.get("method")
        if route == "models" and method == "GET":
            return 200, {"object": "list", "data": [{"id": self.endpoint.settings.model, "object": "model"}]}
        handlers = {"chat/completions": self.endpoint.chat_completion, "completions": self.endpoint.completion}
        handler = handlers.get(route)
        if handler is None or method != "POST":
            return _error(404, f"no route {method} /v1/{route}; served: POST chat/completions, POST completions")
        body = await _read_json(receive)
        if isinstance(body, tuple):
            return body
        try:
            return 200, await handler(episode, body)
        except AgentAppError as error:
            episode.refuse(error)
            return _error(error.status, str(error))
        except Exception as error:  # the generator's: the stage fails the run with it
            episode.fail(error)
            return _error(500, f"{type(error).__name__}: {error}")


async def _read_json(receive: Receive) -> dict[str, Any] | tuple[int, dict[str, Any]]:
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return _error(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    try:
        body = json.loads(b"".join(chunks) or b"{}")
    except ValueError as error:
        return _error(400, f"the request body is not JSON: {error}")
    except RecursionError:
        return _error(400, "the request body's JSON is nested too deeply to read")
    return body if isinstance(body, dict) else _error(400, "the request body must be a JSON object")


def _error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "code": status}}


def openai_client(routes: EpisodeRoutes, key: str, *, base_url: str | None = None) -> Any:
    """An ``openai.AsyncOpenAI`` for the episode ``key``: through the ASGI app in this process, or
    to ``base_url`` (a :class:`LocalServer`'s URL) when given. Close it with ``await client.close()``."""
    try:
        import httpx
        from openai import AsyncOpenAI
    except ImportError as error:
        raise MissingExtraError("an agent app's OpenAI client", "openai", "openai") from error
    if base_url is not None:
        return AsyncOpenAI(base_url=base_url, api_key="thundersync", max_retries=0)
    transport = httpx.ASGITransport(app=routes)
    http = httpx.AsyncClient(transport=transport, timeout=None)
    return AsyncOpenAI(
        base_url=f"http://thundersync/e/{key}/v1", api_key="thundersync", http_client=http, max_retries=0
    )


class LocalServer(AbstractAsyncContextManager["LocalServer"]):
    """Serves ``routes`` over HTTP on ``host:port`` (port 0: a free one) for the duration of an
    ``async with``; :meth:`base_url` gives an episode's URL."""

    def __init__(self, routes: EpisodeRoutes, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.routes, self.host, self.port = routes, host, port
        self._server: Any = None
        self._group: anyio.abc.TaskGroup | None = None

    def base_url(self, key: str) -> str:
        return f"http://{self.host}:{self.port}/e/{key}/v1"

    async def __aenter__(self) -> LocalServer:
        try:
            import uvicorn
        except ImportError as error:
            raise MissingExtraError("serving agent apps over HTTP", "openai", "uvicorn") from error

        started = anyio.Event()

        class _Server(uvicorn.Server):
            def capture_signals(self) -> Any:  # the command handles Ctrl-C, not the endpoint
                return _NoSignals()

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                started.set()

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.routes, lifespan="off", log_config=None, access_log=False, log_level="warning")
        self._server = _Server(config)
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._server.serve, [sock])
        with anyio.fail_after(30):
            await started.wait()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._group is not None:
            await self._group.__aexit__(exc_type, exc, traceback)


class _NoSignals:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None
