"""The router's prompt for a chat request is the engine's, token for token: tools, tool calls and
tool results in the history, and template variables included (prefix routing matches on it)."""

from __future__ import annotations

import asyncio
import json

from pdserve.api.chat import conversation
from pdserve.api.protocol import ChatCompletionRequest, decode_request
from pdserve.models.demo import ensure_demo_model
from pdserve.router.prompt import PromptReader
from pdserve.server.input_processor import InputProcessor

BODY = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "chat_template_kwargs": {"enable_thinking": False},
}


def test_the_router_renders_a_tool_conversation_as_the_engine_does():
    reader = PromptReader(str(ensure_demo_model()))
    try:
        request = decode_request(json.dumps(BODY).encode(), ChatCompletionRequest)
        routed = asyncio.run(reader.read(request, chat=True))
        processor = InputProcessor(reader.tokenizer, len(reader.tokenizer), 4096, [])
        messages, template_kwargs = conversation(request)
        engine = processor.chat_prompt(messages, True, template_kwargs).token_ids
    finally:
        reader.close()
    assert routed is not None and list(routed.token_ids) == engine
    text = reader.tokenizer.decode(engine)
    assert '"name": "get_weather"' in text and "<tool_response>\nrain\n</tool_response>" in text
    assert text.endswith("<think>\n\n</think>\n\n")
