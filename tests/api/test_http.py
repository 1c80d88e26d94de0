"""The HTTP toolkit shared by engines and router: errors are OpenAI-style JSON with the right
status and headers (a 405 keeps Allow), the API key is checked on /v1 and /debug only."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from pdserve.api.http import api_key_middleware, base_url, error_middleware, start_app
from pdserve.api.protocol import ProtocolError


class _Mine(Exception):
    pass


def _app() -> web.Application:
    def mapped(error: Exception) -> ProtocolError | None:
        return ProtocolError("mine", 418, param="x") if isinstance(error, _Mine) else None

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("secret detail")

    async def mine(request: web.Request) -> web.Response:
        raise _Mine

    app = web.Application(middlewares=[error_middleware(mapped, lambda r: {"X-Test": "1"}), api_key_middleware("k")])
    app.router.add_post("/v1/completions", ok)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/boom", boom)
    app.router.add_get("/v1/mine", mine)
    return app


async def _exchange() -> dict[str, tuple[int, dict, dict]]:
    runner, url = await start_app(_app(), "127.0.0.1", 0)
    answers = {}
    auth = {"Authorization": "Bearer k"}
    try:
        async with aiohttp.ClientSession() as session:
            for name, method, path, headers in (
                ("405", "GET", "/v1/completions", auth),
                ("401", "POST", "/v1/completions", {}),
                ("401-wrong", "POST", "/v1/completions", {"Authorization": "Bearer kk"}),
                ("200", "POST", "/v1/completions", auth),
                ("open", "GET", "/health", {}),
                ("404", "GET", "/nowhere", {}),
                ("500", "GET", "/v1/boom", auth),
                ("418", "GET", "/v1/mine", auth),
            ):
                async with session.request(method, url + path, headers=headers) as answer:
                    answers[name] = (answer.status, dict(answer.headers), await answer.json())
    finally:
        await runner.cleanup()
    return answers


def test_errors_are_openai_json_with_their_headers_and_the_key_guards_v1():
    answers = asyncio.run(_exchange())
    status, headers, body = answers["405"]
    assert status == 405 and headers["Allow"] == "POST" and body["error"]["code"] == 405  # RFC 9110
    for name in ("401", "401-wrong"):
        assert answers[name][0] == 401 and answers[name][2]["error"]["type"] == "authentication_error"
    assert answers["200"][0] == 200 and answers["open"][0] == 200
    assert answers["404"][0] == 404 and answers["404"][2]["error"]["type"] == "not_found_error"
    status, headers, body = answers["500"]
    assert status == 500 and "secret detail" not in body["error"]["message"] and headers["X-Test"] == "1"
    assert answers["418"][0] == 418 and answers["418"][2]["error"]["param"] == "x"


def test_urls_bracket_ipv6_hosts():
    assert base_url("::1", 80) == "http://[::1]:80" and base_url("127.0.0.1", 80) == "http://127.0.0.1:80"
