"""The router's HTTP face: its routes (OpenAI endpoints, health, metrics, OpenAPI, /debug/index) on the router's
own HTTP server (``http_server.py``) behind the shared API-key check (pdserve.api.http), the life of what runs
beside requests (client session, health checks, KV-event subscriptions, discovery), and ``start_router``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import msgspec

from pdserve.api.http import PROTECTED_PREFIXES, ApiKeyCheck, base_url
from pdserve.api.keys import EVENTS_KEY, load_secret
from pdserve.api.openapi import MAX_BODY_BYTES, ApiLimits, openapi_document, read_limits
from pdserve.router.admission import Admission, FlowMetrics, FlowSettings, PodSignals, Saturation
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import KubernetesDiscovery
from pdserve.router.exchange import REQUEST_ID, REQUEST_ID_KEY
from pdserve.router.http_server import HttpServer, Request, Response, Routes, StreamResponse, json_response
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pods import HealthChecker, Pod, PodSet, no_decode_pod
from pdserve.router.policies import ROUTING_POLICIES
from pdserve.router.policy import Chooser
from pdserve.router.prompt import PromptReader
from pdserve.router.proxy import Proxy
from pdserve.router.subscriber import KVSubscriber
from pdserve.router.tenants import Tenants, parse_priority_range

logger = logging.getLogger(__name__)

SHUTDOWN_S = 60.0  # how long a stopping router lets requests under way finish (aiohttp's default, as before)


class Router:
    """One router replica: ``start()``, serve ``routes()`` (``start_router`` does both), ``stop()``. A client that
    goes away cancels its handler, and so the legs still running for it."""

    def __init__(self, config: RouterConfig) -> None:
        if config.discovery not in ("static", "kubernetes"):
            raise ValueError(f"discovery must be static or kubernetes, got {config.discovery!r}")
        if config.discovery == "static" and not config.decode_urls:
            raise ValueError("the router needs at least one decode pod (or --discovery kubernetes)")
        self.config = config
        self.index = KVIndex()
        self.metrics = RouterMetrics(self.index)
        self.prefill = PodSet("prefill", config.prefill_urls)
        self.decode = PodSet("decode", config.decode_urls)
        self.chooser = Chooser(config, self.index)
        if ROUTING_POLICIES[config.routing].matches_prefixes and config.tokenizer is None:
            logger.warning(
                "--routing %s needs the model's tokenizer (--tokenizer PATH) to hash prompts; "
                "choosing pods by least load instead",
                config.routing,
            )
        # Prompts are tokenized only for what uses them: prefix routing, or the P/D decider (prefill pods present).
        prompts = None
        if config.tokenizer is not None and (
            self.chooser.prefix_aware
            or (config.pd_min_prefill_tokens > 0 and (config.prefill_urls or config.discovery != "static"))
        ):
            prompts = PromptReader(config.tokenizer)
        self.tenants = Tenants.load(config.tenants, config.tenant_header, parse_priority_range(config.priority_range))
        self.admission = Admission(
            FlowSettings(config.max_queued, config.router_replicas, config.max_ahead if config.flow_control else 0),
            PodSignals(self.prefill, self.decode, self.index, config.saturation_queue, config.saturation_kv)
            if config.flow_control
            else _never_saturated,
            FlowMetrics(self.metrics.registry),
        )
        self.proxy = Proxy(
            config, self.prefill, self.decode, self.metrics, self.chooser, prompts, self.tenants, self.admission
        )
        # The engines' KV-cache events: prefix routing matches prompts against them, flow control reads their load.
        self.subscriber = (
            KVSubscriber(
                self.index,
                self.metrics.malformed_events.inc,
                load_secret(config.keys_dir, EVENTS_KEY) if config.keys_dir else None,
                self.admission.signals_changed,
            )
            if self.chooser.prefix_aware or config.flow_control
            else None
        )
        self._health: HealthChecker | None = None
        self._probe: asyncio.Task[None] | None = None
        self._discovery: KubernetesDiscovery | None = None
        self._openapi: bytes | None = None
        self._session: aiohttp.ClientSession | None = None

    def routes(self) -> Routes:
        routes = Routes()
        routes.add("POST", "/v1/completions", self.completions)
        routes.add("POST", "/v1/chat/completions", self.chat_completions)
        routes.add("GET", "/v1/models", self.models)
        routes.add("GET", "/health", self.health)
        routes.add("GET", "/metrics", self.render_metrics)
        routes.add("GET", "/openapi.json", self.openapi)
        routes.add("GET", "/debug/index", self.debug_index)
        return routes

    def key_check(self) -> ApiKeyCheck:
        """Tenant keys authenticate clients on /v1/ (the proxy asks the tenant table); --api-key is then the key of
        /debug/ and of the engines."""
        return ApiKeyCheck(self.config.api_key, ("/debug/",) if self.tenants.keyed else PROTECTED_PREFIXES)

    async def start(self) -> None:
        # Health probes and documents (legs have their own client): connections reused, no pool limit.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout),
        )
        self.proxy.upstream.session = self._session = session
        self._health = HealthChecker(
            session,
            [self.prefill, self.decode],
            self.config.health_interval,
            self.metrics.ejections.inc,
            self._on_health if self.subscriber else None,
        )
        await self._health.check_all()  # so /health and the first choices are right from the start
        self._health.start()
        if self.config.discovery == "kubernetes":
            self._discovery = KubernetesDiscovery(
                self.config.namespace or _own_namespace(),
                self.config.selector,
                self._apply_snapshot,
                asyncio.get_running_loop(),
                self.config.inference_pool,
            )
            self._discovery.start()

    def _on_health(self, pod: Pod, kv_events_port: int | None) -> None:
        # A probe that was under way when discovery dropped its pod must not subscribe to it again.
        if self.subscriber is not None and (pod in self.decode.pods or pod in self.prefill.pods):
            self.subscriber.follow(pod.url, kv_events_port, pod.engine_id)

    def _apply_snapshot(self, snapshot: dict[str, list[str]]) -> None:
        self.prefill.set_urls(snapshot["prefill"])
        self.decode.set_urls(snapshot["decode"])
        logger.info("pods: prefill %s; decode %s", snapshot["prefill"] or "none", snapshot["decode"] or "none")
        urls = {pod.url for podset in (self.prefill, self.decode) for pod in podset.pods}
        if self.subscriber is not None:
            self.subscriber.retain(urls)
        self.metrics.forget_pods(urls)
        if self._health is not None:  # probe newcomers now: health and KV events without waiting an interval
            self._probe = asyncio.get_running_loop().create_task(self._health.check_all())

    async def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.stop()
        if self._health is not None:
            await self._health.stop()
        if self._probe is not None:
            self._probe.cancel()
        if self.subscriber is not None:
            await self.subscriber.close()
        if self.proxy.prompts is not None:
            self.proxy.prompts.close()
        self.proxy.upstream.legs.close()
        if self._session is not None:
            await self._session.close()

    async def completions(self, request: Request) -> Response | StreamResponse:
        return await self.proxy.forward(request, chat=False)

    async def chat_completions(self, request: Request) -> Response | StreamResponse:
        return await self.proxy.forward(request, chat=True)

    async def models(self, request: Request) -> Response:
        """The first healthy decode pod's model list (every pod serves the same model)."""
        headers = self.proxy.engine_headers(request.headers, self.tenants.identify(request.headers))
        ordered = sorted(self.decode.pods, key=lambda pod: not pod.healthy)
        for pod in ordered:
            try:
                async with self.proxy.upstream.session.get(pod.url + "/v1/models", headers=headers) as answer:
                    return Response(
                        await answer.read(),
                        answer.status,
                        content_type=answer.headers.get("Content-Type", "application/json"),
                    )
            except aiohttp.ClientError:
                continue
        raise no_decode_pod(self.config.health_interval)

    async def health(self, request: Request) -> Response:
        if not self.decode.any_healthy():
            return json_response({"status": "no decode pod is up"}, status=503)
        return json_response({"status": "ok"})

    async def debug_index(self, request: Request) -> Response:
        """What the router believes each pod has cached (``?hashes=1``: the hashes too, hex), and its load."""
        with_hashes = request.query.get("hashes", "") not in ("", "0", "false")
        return json_response(
            {
                "routing": self.config.routing,
                "prefix_aware": self.chooser.prefix_aware,
                "subscriptions": self.subscriber.endpoints() if self.subscriber else {},
                "pods": self.index.summary(with_hashes),
            }
        )

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), content_type="text/plain; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        """The engines' API as the router serves it, with their limits (context length, vocabulary...), which it
        learns from a decode pod's document; until one answers, the document states the fields without them."""
        if self._openapi is not None:
            return Response(self._openapi, content_type="application/json")
        limits = await self._engine_limits()
        document = msgspec.json.encode(
            openapi_document(
                "pdserve router", "v1", server="router", limits=limits, api_key=self.config.api_key is not None
            )
        )
        if limits is not None:
            self._openapi = document
        return Response(document, content_type="application/json")

    async def _engine_limits(self) -> ApiLimits | None:
        for pod in sorted(self.decode.pods, key=lambda pod: not pod.healthy):
            try:
                async with self.proxy.upstream.session.get(
                    pod.url + "/openapi.json", timeout=aiohttp.ClientTimeout(total=10)
                ) as answer:
                    if answer.status == 200:
                        limits = read_limits(msgspec.json.decode(await answer.read()))
                        if limits is not None:
                            return limits
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
                continue
        return None


def _never_saturated(pending: object) -> Saturation:
    """--no-flow-control: every request goes at once (the tenants' limits still apply)."""
    return Saturation(None, PodSignals.UNKNOWN)


def _own_namespace() -> str:
    """The pod's namespace inside a cluster (its service account's), else "default"."""
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as handle:
            return handle.read().strip()
    except OSError:
        return "default"


def _request_id_header(request: Request) -> dict[str, str]:
    """Error answers carry the request's id too, once the proxy assigned one."""
    request_id = request.get(REQUEST_ID_KEY)
    return {REQUEST_ID: request_id} if request_id is not None else {}


@dataclass
class RunningRouter:
    """A started router: its URL, and how to stop it."""

    url: str
    router: Router
    server: HttpServer

    async def close(self, shutdown_timeout: float = SHUTDOWN_S) -> None:
        """Stop taking connections, let the requests under way finish (at most ``shutdown_timeout`` seconds), stop."""
        try:
            await self.server.stop(shutdown_timeout)
        finally:
            await self.router.stop()


async def start_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 0) -> RunningRouter:
    """Start a router on ``host:port`` (0 picks a free port) in the running event loop."""
    router = Router(config)
    await router.start()
    try:
        server = HttpServer(router.routes(), MAX_BODY_BYTES, router.key_check().refusal, _request_id_header)
        port = await server.start(host, port)
    except BaseException:
        await router.stop()
        raise
    url = base_url(host, port)
    logger.info("router at %s: %d prefill, %d decode pods", url, len(router.prefill), len(router.decode))
    return RunningRouter(url, router, server)
