"""The endpoint picker (``pdserve epp``): the router's pod choice and flow control behind a gateway, as the Gateway
API Inference Extension defines it. Envoy (or any proxy speaking its external processing protocol, ext_proc, over
gRPC) asks the picker for every request; the picker answers with the pod, and the proxy sends the request there.

The protocol (GIE's endpoint picker protocol): for each HTTP request the proxy opens an ext_proc stream, sends the
request headers, then (``request_body_mode: BUFFERED``) the whole body. The picker answers the headers with
"continue", and the body with the chosen pod as ``ip:port`` in the ``x-gateway-destination-endpoint`` header and in
the dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint`` (the same value in both); the proxy routes by
it (an ``ORIGINAL_DST`` cluster reading that header). When the proxy's request ends, the stream ends, and the
picker counts the request out of the pod's load and out of its tenant's admission.

What the picker decides is what the router decides, with the same parts (``Router``): the tenant (a tenant key or
the trusted gateway header), the clamped priority (written into the body), admission (429 with ``Retry-After``
as an immediate response while the fleet is saturated past the request's patience), the pod by the routing policy
over the KV-event index. Refusals are immediate responses with the OpenAI error body. The picker chooses a decode
pod (colocated engines are decode pods that prefill themselves) and, when there are prefill pods and the request is
worth a prefill leg (the router's rules), names one of the decode pod's KV layout in ``X-PDServe-Prefill-Via`` with
the router's signature of the leg in ``X-PDServe-Prefill-Auth``: the decode pod sends the leg itself
(``pdserve.server.gateway_prefill``), the GIE ecosystem's P/D shape.

What the proxy does when the picker is down is its own setting (Envoy's ``failure_mode_allow``: false, the default,
answers 500; docs/kubernetes.md).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from pdserve.api.prefill_leg import PREFILL_AUTH_HEADER, PREFILL_VIA_HEADER, encoded_leg
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, decode_request
from pdserve.api.tenancy import AHEAD_HEADER, TENANT_HEADER
from pdserve.router.admission import Ticket
from pdserve.router.exchange import REQUEST_ID
from pdserve.router.pods import Pod, no_decode_pod
from pdserve.router.policy import Choice, uncached_tokens
from pdserve.router.proxy import QUEUE_TIMEOUT_HEADER, SESSION_ID, needs_local_prefill, output_bound, queue_timeout
from pdserve.router.server import Router

logger = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
METADATA_NAMESPACE = "envoy.lb"
GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}


def _headers(message: ext_proc.HttpHeaders) -> dict[str, str]:
    """The request's headers, names in lower case (HTTP/2's), values from raw_value where the proxy sends them."""
    return {
        header.key.lower(): header.raw_value.decode("utf-8", "surrogateescape") if header.raw_value else header.value
        for header in message.headers.headers
    }


class _Headers(dict[str, str]):
    """Header lookups by any case, as aiohttp's are (the tenant table asks for ``Authorization``)."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _refusal(error: ProtocolError) -> ext_proc.ProcessingResponse:
    headers = ext_proc.HeaderMutation(
        set_headers=[_set("content-type", "application/json"), *(_set(k, v) for k, v in error.headers.items())]
    )
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=headers,
            body=msgspec.json.encode(error.to_response()),
            details=error.message[:200],
        )
    )


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router) -> None:
        self.router = router
        config = router.config
        # Without tenant keys, the proxy's requests must carry the router's --api-key, as the router's own do.
        self._expected_key = (
            f"Bearer {config.api_key}" if config.api_key is not None and not router.tenants.keyed else None
        )

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        headers = _Headers()
        body = bytearray()
        held: list[tuple[Pod, Ticket | None]] = []
        try:
            async for message in requests:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    headers = _Headers(_headers(message.request_headers))
                    if message.request_headers.end_of_stream:  # no body (GET /v1/models): any decode pod will do
                        yield self._route_other(headers, held)
                    else:
                        yield ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
                elif kind == "request_body":
                    body += message.request_body.body
                    if message.request_body.end_of_stream:
                        yield await self._pick(headers, bytes(body), held)
                else:  # a phase the proxy was not asked to send: let it through unchanged
                    yield ext_proc.ProcessingResponse(**{kind: _continue(kind)})
        finally:
            for pod, ticket in held:
                pod.in_flight -= 1
                if ticket is not None:
                    self.router.admission.done(ticket)

    async def _pick(
        self, headers: _Headers, raw: bytes, held: list[tuple[Pod, Ticket | None]]
    ) -> ext_proc.ProcessingResponse:
        path = headers.get(":path", "").split("?", 1)[0]
        chat = GENERATION_PATHS.get(path)
        if chat is None:
            return self._route_other(headers, held)
        router = self.router
        try:
            self._check_key(headers)
            tenant = router.tenants.identify(headers)
            parsed = decode_request(raw, ChatCompletionRequest if chat else CompletionRequest)
            router.metrics.received.inc()
            priority = tenant.clamp(parsed.priority)
            rewrite = priority != (parsed.priority or 0) or parsed.kv_transfer_params is not None
            if rewrite:
                fields = msgspec.json.decode(raw)
                fields["priority"] = priority
                fields.pop("kv_transfer_params", None)  # the P/D protocol is the router's to speak
                raw = msgspec.json.encode(fields)
            ticket = await router.admission.admit(
                tenant,
                priority,
                len(raw) // 4,
                output_bound(parsed),
                queue_timeout(headers.get(QUEUE_TIMEOUT_HEADER)),
            )
        except ProtocolError as error:
            return _refusal(error)
        engine_headers = router.proxy.engine_headers(headers, tenant)
        prompt = None
        prompts = router.proxy.prompts
        if prompts is not None and router.chooser.prefix_aware:
            prompt = await prompts.read(
                parsed, chat, engine_headers.get("Authorization"), engine_headers.get(TENANT_HEADER)
            )
        session = (headers.get(SESSION_ID) or parsed.user) if router.config.session_affinity else None
        # A P/D pair: the decode pod sends the prefill leg itself (pdserve/server/gateway_prefill.py).
        leg = encoded_leg(raw, chat) if router.prefill.pods and not needs_local_prefill(parsed, chat) else None
        response = self._route(headers, engine_headers, held, ticket, prompt, session, (path, leg))
        if rewrite and response.HasField("request_headers"):
            common = response.request_headers.response
            response = ext_proc.ProcessingResponse(
                request_body=ext_proc.BodyResponse(
                    response=ext_proc.CommonResponse(
                        header_mutation=common.header_mutation, body_mutation=ext_proc.BodyMutation(body=raw)
                    )
                ),
                dynamic_metadata=response.dynamic_metadata,
            )
        elif response.HasField("request_headers"):
            response = ext_proc.ProcessingResponse(
                request_body=ext_proc.BodyResponse(response=response.request_headers.response),
                dynamic_metadata=response.dynamic_metadata,
            )
        return response

    def _route_other(self, headers: _Headers, held: list[tuple[Pod, Ticket | None]]) -> ext_proc.ProcessingResponse:
        """A request that is no generation (``/v1/models``, say): the same keys, no admission, any decode pod."""
        try:
            self._check_key(headers)
            tenant = self.router.tenants.identify(headers)
        except ProtocolError as error:
            return _refusal(error)
        return self._route(headers, self.router.proxy.engine_headers(headers, tenant), held)

    def _check_key(self, headers: _Headers) -> None:
        expected = self._expected_key
        if expected is not None and headers.get("authorization") != expected:
            raise ProtocolError("invalid or missing API key", 401, error_type="authentication_error")

    def _route(
        self,
        headers: _Headers,
        engine_headers: dict[str, str],
        held: list[tuple[Pod, Ticket | None]],
        ticket: Ticket | None = None,
        prompt: Any = None,
        session: str | None = None,
        prefill_leg: tuple[str, bytes | None] = ("", None),
    ) -> ext_proc.ProcessingResponse:
        """The answer naming the chosen decode pod (as a headers answer; ``_pick`` turns it into a body answer), and
        the prefill pod when ``prefill_leg`` (path, bytes) has a leg worth sending."""
        router = self.router
        choice = router.chooser.choose(router.decode, prompt, session)
        if choice is None:
            if ticket is not None:
                router.admission.done(ticket)
            router.metrics.errors["no_decode"].inc()
            return _refusal(no_decode_pod(router.config.health_interval))
        pod = choice.pod
        pod.take()
        held.append((pod, ticket))
        router.metrics.chose("decode", pod.url, choice.policy)
        destination = urlsplit(pod.url).netloc
        # Clients' copies of what only the picker may say never pass.
        removed = [TENANT_HEADER.lower(), AHEAD_HEADER.lower(), PREFILL_VIA_HEADER.lower(), PREFILL_AUTH_HEADER.lower()]
        mutation = ext_proc.HeaderMutation(set_headers=[_set(DESTINATION_HEADER, destination)], remove_headers=removed)
        path, leg = prefill_leg
        if leg is not None:
            mutation.set_headers.extend(self._prefill_headers(choice, prompt, session, path, leg))
        if "Authorization" not in engine_headers:
            mutation.remove_headers.append("authorization")
        mutation.set_headers.extend(_set(name, value) for name, value in engine_headers.items())
        if ticket is not None and ticket.ahead:
            mutation.set_headers.append(_set(AHEAD_HEADER, "1"))  # the decode pod passes it to its prefill leg
        if headers.get(REQUEST_ID) is None:  # the engines' logs name it
            mutation.set_headers.append(_set(REQUEST_ID.lower(), uuid.uuid4().hex))
        metadata = struct_pb2.Struct()
        metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: destination}})
        return ext_proc.ProcessingResponse(
            request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(header_mutation=mutation)),
            dynamic_metadata=metadata,
        )

    def _prefill_headers(
        self, decode: Choice, prompt: Any, session: str | None, path: str, leg: bytes
    ) -> list[base_pb2.HeaderValueOption]:
        """The prefill pod the decode pod is to send ``leg`` to, and the router's signature of it for that pod's
        engine; none when the leg is not worth sending (the decode pod has the prompt nearly all cached) or no
        prefill pod of the decode pod's KV layout is up: then the decode pod computes the prompt."""
        router = self.router
        threshold = router.config.pd_min_prefill_tokens
        if threshold and prompt is not None and uncached_tokens(prompt, decode) < threshold:
            router.metrics.prefill_skipped.inc()
            return []
        incompatible = [pod for pod in router.prefill.pods if pod.compat_hash != decode.pod.compat_hash]
        choice = router.chooser.choose(router.prefill, prompt, session, exclude=incompatible, healthy_only=True)
        if choice is None:
            router.metrics.errors["no_prefill"].inc()
            return []
        router.metrics.chose("prefill", choice.pod.url, choice.policy)
        headers = [_set(PREFILL_VIA_HEADER, choice.pod.url)]
        signature = router.proxy.upstream.sign(choice.pod, path, leg)
        if signature is not None:
            headers.append(_set(PREFILL_AUTH_HEADER, signature))
        return headers


def _continue(kind: str) -> Any:
    """The "go on unchanged" answer to a phase of kind ``kind`` (e.g. ``response_headers``)."""
    phase = kind.rsplit("_", 1)[1]
    return {"headers": ext_proc.HeadersResponse, "body": ext_proc.BodyResponse}.get(phase, ext_proc.TrailersResponse)()


async def start_picker(router: Router, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve the picker on ``host:port`` (0: a free port) in the running loop; returns the server and its port."""
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(router), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    logger.info("endpoint picker (ext_proc) at %s:%d", host, bound)
    return server, bound
