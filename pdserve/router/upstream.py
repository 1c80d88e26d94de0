"""Upstream: how the router reaches engines. Legs and releases go through the router's own keep-alive client
(``leg_client``); one aiohttp session carries the rest (model lists, OpenAPI documents; set at start-up: it
needs the running loop). Each POST is signed for the engine it goes to when the router has keys
(engines take P/D params and releases only from the router); a pod's failures count toward its ejection; and
the usage an engine's answer reports feeds the predicted-against-realised prefix-hit metrics.
"""

from __future__ import annotations

import aiohttp
import msgspec

from pdserve.api.auth import ENGINE_ID_HEADER, ENGINE_LEG_KEY_HEADER, ROUTER_AUTH_HEADER, RouterSigner
from pdserve.api.keys import load_router_signing
from pdserve.router.config import RouterConfig
from pdserve.router.leg_client import LegAnswer, LegClient
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pods import Pod, PodSet
from pdserve.router.policy import Choice


class Details(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """The part of an answer's ``usage`` the router reads."""

    prompt_tokens: int = 0
    prompt_tokens_details: Details | None = None


class UsageAnswer(msgspec.Struct):
    usage: Usage | None = None


class Upstream:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self.legs = LegClient(config.connect_timeout)
        self._signer = RouterSigner(load_router_signing(config.keys_dir)) if config.keys_dir else None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client session of what is not a leg (made at start-up: it needs the running loop)."""
        if self._session is None:
            raise RuntimeError("the router has not started")
        return self._session

    @session.setter
    def session(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def post(self, pod: Pod, path: str, body: bytes, headers: dict[str, str]) -> LegAnswer:
        """POST one leg (or release) to an engine, made for that engine (its id and leg key from /health) when
        the router has keys. An engine that refuses it as made for another (it restarted: a new id) says its id
        and leg key; the leg is made for that one and sent again, once."""
        for attempt in range(2):
            signed = headers
            if self._signer is not None:
                auth = self._signer.leg_header("POST", path, body, pod.engine_id or "", pod.leg_key)
                signed = {**headers, ROUTER_AUTH_HEADER: auth}
            answer = await self.legs.post(pod.url + path, body, signed)
            engine_id = answer.headers.get(ENGINE_ID_HEADER)
            if answer.status != 403 or not engine_id or engine_id == pod.engine_id or attempt or self._signer is None:
                return answer
            pod.engine_id = engine_id
            pod.leg_key = answer.headers.get(ENGINE_LEG_KEY_HEADER)
            answer.release()
        raise AssertionError("unreachable")

    def sign(self, pod: Pod, path: str, body: bytes) -> str | None:
        """The router's signature of a POST of ``body`` to ``path`` on ``pod``'s engine, for someone else to send
        (a decode engine behind a gateway sends the prefill leg the picker signed); None without keys."""
        return None if self._signer is None else self._signer.header("POST", path, body, pod.engine_id or "")

    def capability(self, reader: str, holder: str, handle: str, expires_at: float) -> str:
        """A peer-read capability for engine ``reader`` (``RouterSigner.capability``); empty without keys."""
        return "" if self._signer is None else self._signer.capability(reader, holder, handle, expires_at)

    def eject(self, podset: PodSet, pod: Pod, reason: str) -> None:
        """Out of rotation at once (nothing listens there, or it hangs) until its health probe answers again."""
        if podset.mark(pod, False, reason):
            self.metrics.ejections.inc()

    def failed(self, podset: PodSet, pod: Pod, reason: str) -> None:
        """One more failure of ``pod``: out of rotation after ``failure_threshold`` in a row."""
        if podset.failed(pod, reason, self.config.failure_threshold):
            self.metrics.ejections.inc()

    def observe(self, role: str, choice: Choice, usage: Usage | None) -> None:
        """Predicted against realised prefix hit of a leg whose answer reported usage."""
        if usage is None or usage.prompt_tokens_details is None or not choice.block_size:
            return
        self.metrics.predicted[role].inc(choice.matched)
        self.metrics.realised[role].inc(usage.prompt_tokens_details.cached_tokens // choice.block_size)
