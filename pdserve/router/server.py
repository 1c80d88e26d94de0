"""The router's HTTP face: the aiohttp application (OpenAI endpoints, health, metrics, OpenAPI, /debug/index)
with the shared API-key and error middlewares (pdserve.api.http), the life of what runs beside requests
(client session, health checks, KV-event subscriptions, discovery), and ``start_router``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from pdserve.api.http import PROTECTED_PREFIXES, api_key_middleware, error_middleware, start_app
from pdserve.api.keys import EVENTS_KEY, load_secret
from pdserve.api.openapi import MAX_BODY_BYTES, ApiLimits, openapi_document, read_limits
from pdserve.router.admission import Admission, FlowMetrics, FlowSettings, PodSignals, Saturation
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import KubernetesDiscovery
from pdserve.router.exchange import REQUEST_ID, REQUEST_ID_KEY
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


class Router:
    """One router replica. Serve ``app()`` with ``handler_cancellation=True`` (start_router does), so that a
    client that goes away also cancels the legs still running for it."""

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
            FlowSettings(config.max_queued, config.router_replicas),
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

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES,
            middlewares=[
                error_middleware(extra_headers=_request_id_header),
                # Tenant keys authenticate clients on /v1/ (the proxy asks the tenant table); --api-key is then the
                # key of /debug/ and of the engines.
                api_key_middleware(self.config.api_key, ("/debug/",) if self.tenants.keyed else PROTECTED_PREFIXES),
            ],
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.render_metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/debug/index", self.debug_index)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
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

    async def _stop(self, app: web.Application) -> None:
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

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.forward(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.proxy.forward(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        """The first healthy decode pod's model list (every pod serves the same model)."""
        headers = self.proxy.engine_headers(request.headers, self.tenants.identify(request.headers))
        ordered = sorted(self.decode.pods, key=lambda pod: not pod.healthy)
        for pod in ordered:
            try:
                async with self.proxy.upstream.session.get(pod.url + "/v1/models", headers=headers) as answer:
                    return web.Response(
                        body=await answer.read(),
                        status=answer.status,
                        headers={"Content-Type": answer.headers.get("Content-Type", "application/json")},
                    )
            except aiohttp.ClientError:
                continue
        raise no_decode_pod(self.config.health_interval)

    async def health(self, request: web.Request) -> web.Response:
        if not self.decode.any_healthy():
            return web.json_response({"status": "no decode pod is up"}, status=503)
        return web.json_response({"status": "ok"})

    async def debug_index(self, request: web.Request) -> web.Response:
        """What the router believes each pod has cached (``?hashes=1``: the hashes too, hex), and its load."""
        with_hashes = request.query.get("hashes", "") not in ("", "0", "false")
        return web.json_response(
            {
                "routing": self.config.routing,
                "prefix_aware": self.chooser.prefix_aware,
                "subscriptions": self.subscriber.endpoints() if self.subscriber else {},
                "pods": self.index.summary(with_hashes),
            }
        )

    async def render_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def openapi(self, request: web.Request) -> web.Response:
        """The engines' API as the router serves it, with their limits (context length, vocabulary...), which it
        learns from a decode pod's document; until one answers, the document states the fields without them."""
        if self._openapi is not None:
            return web.Response(body=self._openapi, content_type="application/json")
        limits = await self._engine_limits()
        document = msgspec.json.encode(
            openapi_document(
                "pdserve router", "v1", server="router", limits=limits, api_key=self.config.api_key is not None
            )
        )
        if limits is not None:
            self._openapi = document
        return web.Response(body=document, content_type="application/json")

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


def _request_id_header(request: web.Request) -> dict[str, str]:
    """Error answers carry the request's id too, once the proxy assigned one."""
    request_id = request.get(REQUEST_ID_KEY)
    return {REQUEST_ID: request_id} if request_id is not None else {}


@dataclass
class RunningRouter:
    """A started router: its URL, and how to stop it."""

    url: str
    router: Router
    runner: web.AppRunner

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 0) -> RunningRouter:
    """Start a router on ``host:port`` (0 picks a free port) in the running event loop."""
    router = Router(config)
    runner, url = await start_app(router.app(), host, port)
    logger.info("router at %s: %d prefill, %d decode pods", url, len(router.prefill), len(router.decode))
    return RunningRouter(url, router, runner)
