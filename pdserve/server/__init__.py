"""The engine's API process: aiohttp (OpenAI API), tokenization, detokenization, streaming and
metrics, in front of an EngineCore process it talks to over ZMQ (``core_client``). It never
touches a tensor or blocks its event loop on the model.

- ``app``: the application, its routes, start-up and drain;
- ``serving``: completions and chat completions; ``choices``: one core request per choice, run
  concurrently, aborted when the caller stops; ``pd_gate``: what a request's ``kv_transfer_params``
  may make the engine do, parsed and screened once;
- ``input_processor``: prompts and sampling settings checked and turned into core requests
  (shared with the offline ``pdserve.llm.LLM``);
- ``responses``: OpenAI response shapes (usage, logprobs, SSE);
- ``tools``, ``tool_parsers``, ``reasoning``, ``chat_output``: tool calling and reasoning output
  (a chat answer read into reasoning_content, content and tool_calls);
- ``settings``: the API process's own settings and their flags (``ServerSettings``);
- ``core_client``, ``detokenizer``, ``metrics``.
"""
