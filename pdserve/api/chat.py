"""A chat request's conversation as the chat template takes it: the messages as plain dicts (an
assistant message's tool-call arguments parsed into objects, as templates in the style of Qwen's
expect) and the template's variables (``chat_template_kwargs``, and the request's ``tools``).

One definition for the engine's API server and the router: the router renders the same prompt the
engine will, so its prefix-cache routing matches the engine's blocks.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pdserve.api.protocol import ChatCompletionRequest, ChatMessage


class ConversationError(ValueError):
    """A conversation the template cannot be given; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    rendered = []
    for index, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = []
            for number, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError as error:
                    raise ConversationError(
                        f"messages[{index}].tool_calls[{number}].function.arguments", f"is not valid JSON: {error}"
                    ) from None
                function = {"name": call.function.name, "arguments": arguments}
                calls.append({"id": call.id, "type": call.type, "function": function})
            item["tool_calls"] = calls
        rendered.append(item)
    return rendered


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(request.chat_template_kwargs or {})
    if request.tools:
        if "tools" in kwargs:
            raise ConversationError("chat_template_kwargs", "tools are given once: in the request's tools")
        kwargs["tools"] = [
            {"type": tool.type, "function": msgspec.to_builtins(tool.function, builtin_types=None)}
            for tool in request.tools
        ]
        for tool in kwargs["tools"]:  # unset fields are left out, not rendered as nulls
            tool["function"] = {key: value for key, value in tool["function"].items() if value is not None}
    return kwargs


def conversation(request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The request's messages and template variables (ConversationError for what cannot be rendered)."""
    return template_messages(request.messages), template_kwargs(request)
