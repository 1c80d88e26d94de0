"""Tool use of one chat request: its ``tools`` and ``tool_choice`` checked, and what follows from
them: whether the answer is read for tool calls (by which parser), and the grammar that forces calls.

- ``"none"`` (the default without a tool-call parser): the tools are shown to the model (the chat
  template renders them), the answer is content.
- ``"auto"`` (the default with ``--tool-call-parser``): the model may call; its calls are parsed from
  the answer.
- ``"required"``, or a named function: the answer is one call (several with ``parallel_tool_calls``)
  forced by a grammar of the functions' parameter schemas, in the parser's format (hermes's when
  none is configured).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.api.protocol import ChatCompletionRequest, NamedToolChoice
from pdserve.engine.grammar import GrammarError, check_grammar, grammar_spec
from pdserve.engine.sampling_params import StructuredOutputsParams
from pdserve.server.input_processor import InputError
from pdserve.server.tool_parsers import HermesToolParser, ToolParser

# OpenAI's rule for function names; it also keeps them plain literals in the forcing grammar.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolUse:
    parser: ToolParser | None = None  # reads calls from the answer; None: the answer is content
    constraint: StructuredOutputsParams | None = None  # forces calls


def tool_use(request: ChatCompletionRequest, configured: ToolParser | None) -> ToolUse:
    """What ``request``'s tools and tool_choice ask for; InputError naming the field for what cannot be served."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise InputError("tool_choice", "a tool_choice needs tools")
        return ToolUse()
    names = []
    for index, tool in enumerate(tools):
        name = tool.function.name
        if not FUNCTION_NAME.fullmatch(name):
            raise InputError(f"tools[{index}].function.name", "a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -")
        if name in names:
            raise InputError(f"tools[{index}].function.name", f"two tools are named {name!r}")
        names.append(name)
    if choice is None:
        choice = "auto" if configured is not None else "none"
    if choice == "none":
        return ToolUse()
    if choice == "auto":
        if configured is None:
            raise InputError(
                "tool_choice", 'tool_choice "auto" needs a tool-call parser: start the server with --tool-call-parser'
            )
        return ToolUse(parser=configured)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InputError("tool_choice.function.name", f"no tool is named {choice.function.name!r}")
        forced = [names.index(choice.function.name)]
        parallel = False
    else:  # "required"
        forced = list(range(len(tools)))
        parallel = request.parallel_tool_calls is not False
    functions = [(names[index], _parameters(request, index)) for index in forced]
    parser = configured or HermesToolParser()
    try:
        grammar = parser.forced_grammar(functions, parallel)
    except Exception as error:  # xgrammar refusing the functions' schemas together (each passed alone)
        raise InputError("tools", f"the forced call's grammar cannot be built: {error}") from None
    return ToolUse(parser, StructuredOutputsParams(grammar=grammar))


def _parameters(request: ChatCompletionRequest, index: int) -> dict[str, Any]:
    """A forced function's parameter schema, checked as a response_format schema is."""
    assert request.tools is not None
    parameters = request.tools[index].function.parameters
    if parameters is None:  # a function without parameters
        parameters = {"type": "object", "properties": {}}
    try:
        check_grammar(grammar_spec(StructuredOutputsParams(json=parameters)))
    except GrammarError as error:
        raise InputError(f"tools[{index}].function.parameters", str(error).split(": ", 1)[-1]) from None
    return parameters
