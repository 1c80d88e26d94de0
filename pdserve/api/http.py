"""The HTTP toolkit the engine servers and the router share: the API-key check, the error
middleware that turns every failure into an OpenAI-style JSON error, JSON answers, and starting
an aiohttp app on a host and port.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.api.protocol import ProtocolError

logger = logging.getLogger(__name__)

# Paths that need the API key when one is set; /health, /metrics and /openapi.json stay open for
# probes, scrapers and clients discovering the API.
PROTECTED_PREFIXES = ("/v1/", "/debug/")
# Headers of aiohttp's own HTTP errors that an answer must keep: a 405 lists the allowed methods (RFC 9110).
_KEPT_ERROR_HEADERS = ("Allow",)


def json_response(payload: msgspec.Struct, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload), status=status, content_type="application/json", headers=headers
    )


class ApiKeyCheck:
    """With a key, requests under ``prefixes`` need ``Authorization: Bearer <key>`` (401 otherwise).

    Compared in constant time, so the key cannot be guessed byte by byte from response times.
    """

    def __init__(self, api_key: str | None, prefixes: tuple[str, ...] = PROTECTED_PREFIXES) -> None:
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.prefixes = prefixes

    def refusal(self, path: str, headers: Mapping[str, str]) -> ProtocolError | None:
        """The error answering a request for ``path`` with ``headers``; None: it may go on."""
        if self.expected is None or not path.startswith(self.prefixes):
            return None
        given = headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, self.expected):
            return None
        return ProtocolError("invalid or missing API key", status=401, error_type="authentication_error")


def api_key_middleware(api_key: str | None, prefixes: tuple[str, ...] = PROTECTED_PREFIXES) -> Middleware:
    """:class:`ApiKeyCheck` in front of an aiohttp application."""
    check = ApiKeyCheck(api_key, prefixes)

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = check.refusal(request.path, request.headers)
        if refusal is not None:
            raise refusal
        return await handler(request)

    return check_api_key


def error_middleware(
    to_protocol_error: Callable[[Exception], ProtocolError | None] | None = None,
    extra_headers: Callable[[web.Request], dict[str, str]] | None = None,
) -> Middleware:
    """Every failure becomes ``{"error": {...}}`` with the right status; nothing escapes as a bare 500.

    ``to_protocol_error`` maps an application's own exceptions to errors (None: not one of its
    own); ``extra_headers`` adds headers to every error answer (the router's request id).
    """

    def answer(request: web.Request, error: ProtocolError, headers: dict[str, str] | None = None) -> web.Response:
        all_headers = dict(error.headers)
        if headers:
            all_headers.update(headers)
        if extra_headers is not None:
            all_headers.update(extra_headers(request))
        return json_response(error.to_response(), status=error.status, headers=all_headers)

    @web.middleware
    async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProtocolError as error:
            return answer(request, error)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            kept = {name: error.headers[name] for name in _KEPT_ERROR_HEADERS if name in error.headers}
            error_type = "not_found_error" if error.status == 404 else "invalid_request_error"
            return answer(request, ProtocolError(error.reason or "error", error.status, error_type=error_type), kept)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: nobody to answer
        except Exception as error:
            mapped = to_protocol_error(error) if to_protocol_error is not None else None
            if mapped is not None:
                return answer(request, mapped)
            logger.exception("request %s %s failed", request.method, request.path)
            return answer(
                request,
                ProtocolError(f"internal error: {type(error).__name__}", 500, error_type="internal_server_error"),
            )

    return errors_as_json


def base_url(host: str, port: int) -> str:
    """``http://host:port``, with an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port), not yet listening: the port is this process's
    from now on, however many other ports it binds before it serves (``start_app(reserved=...)``)."""
    reserved = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.bind((host, port))
    except BaseException:
        reserved.close()
        raise
    return reserved


async def start_app(
    app: web.Application, host: str, port: int, reserved: socket.socket | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``host:port`` (0: a free port), or on the ``reserved`` socket, in the running
    loop; returns its runner and URL.

    handler_cancellation: a client that leaves cancels its handler at once, whose cleanup aborts
    what the request started (engine requests, router legs), so nothing is held for nobody.
    """
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.SockSite(runner, reserved) if reserved is not None else web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    server: Any = site._server  # aiohttp exposes the bound port only there
    return runner, base_url(host, server.sockets[0].getsockname()[1])
