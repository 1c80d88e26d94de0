"""Exchange: one client request as it goes through the router, the record its path choice and both legs share."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdserve.api.continuation import Continuation
from pdserve.api.report import Report
from pdserve.router.http_server import Request, StreamResponse
from pdserve.router.policy import Choice
from pdserve.router.prompt import Prompt

REQUEST_ID = "X-Request-Id"
REQUEST_ID_KEY = "request_id"  # where the error path finds it (request[REQUEST_ID_KEY]) for error answers


@dataclass
class Exchange:
    request: Request
    headers: dict[str, str]  # sent on both legs
    request_id: str
    body: bytes = b""  # the client's, without kv_transfer_params: what a continuation resends
    peer_hold: str | None = None  # the handle the decode pod holds the finished turn under for peer reads
    response: StreamResponse | None = None  # set once the answer to the client has started
    prompt: Prompt | None = None  # known when pod choice or the decider uses it
    session: str | None = None  # session affinity key
    decode: Choice | None = None  # the decode pod holding the request (counted in its in_flight)
    stream_usage: bool = False  # the decode stream ends with a usage event worth reading
    # Sent with a prefill leg's params: counted "disagg" once decode's answer shows it used them.
    disagg_pending: bool = False
    decode_answered: bool = False  # a decode pod has answered (so it has the request, and its params)
    started: float = 0.0  # time.perf_counter() at its arrival
    decode_sent: float = 0.0  # ... when the decode leg that answered was sent
    report: Report | None = None  # the decode engine's account of the answer (token counts), when it gave one

    def hold(self, choice: Choice | None) -> None:
        """Make ``choice`` the request's decode pod (counted in flight there), instead of any previous one."""
        if self.decode is not None:
            self.decode.pod.in_flight -= 1
        self.decode = choice
        if choice is not None:
            choice.pod.take()

    def continuation_body(self, continuation: Continuation) -> bytes:
        """The client's body asking a decode engine to continue its broken stream."""
        fields = msgspec.json.decode(self.body)
        params: dict[str, object] = {"continue": msgspec.to_builtins(continuation)}
        if self.peer_hold is not None:
            params["kv_peer_hold"] = self.peer_hold
        fields["kv_transfer_params"] = params
        return msgspec.json.encode(fields)

    def cut(self) -> None:
        """End the client's connection: a cut answer must not pass for a whole one."""
        transport = self.request.transport
        if transport is not None:
            transport.close()
