"""The engine server's own settings (the API process around an engine core), with the flags that set them
(``pdserve.api.flags``): the model's name in the API, tool-call parsing, and the bounds that keep an
overloaded or stopping server answering. The engine's settings are ``EngineArgs``'."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.api.flags import add_flags, flag, flag_values
from pdserve.server.serving import ServerLimits
from pdserve.server.tool_parsers import TOOL_PARSERS


@dataclass
class ServerSettings:
    served_model_name: str | None = field(
        default=None, metadata=flag("model id in the API (default: the model folder's name)")
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=flag(
            'read tool calls from answers (tool_choice "auto", the default with tools); hermes: '
            "Qwen's <tool_call>{...}</tool_call>",
            choices=tuple(sorted(TOOL_PARSERS)),
        ),
    )
    max_pending_requests: int = field(
        default=4096,
        metadata=flag("requests (choices) running or queued beyond which new ones get 503 + Retry-After"),
    )
    request_timeout: float | None = field(
        default=None,
        metadata=flag("seconds a request may take before it is aborted with 504 (default: no bound)"),
    )
    drain_timeout: float | None = field(
        default=None,
        metadata=flag(
            "on SIGTERM, seconds to let running requests finish and held KV blocks be pulled "
            "(default: the KV lease + 15 s)"
        ),
    )
    drain_handoff: float = field(
        default=5.0,
        metadata=flag(
            "on SIGTERM, seconds after which the streams the router relays that are still running are handed "
            "back to it, to be continued on another decode pod (short requests finish here first)"
        ),
    )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, ServerSettings)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerSettings:
        return cls(**flag_values(args, cls))

    def limits(self) -> ServerLimits:
        return ServerLimits(max_in_flight=self.max_pending_requests, request_timeout=self.request_timeout)
