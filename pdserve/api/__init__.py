"""The OpenAI-facing protocol layer shared by engines and router: request/response schemas,
errors and SSE framing (``protocol``), tokenizer / chat-template helpers (``tokenizer``) so
the router tokenizes exactly as engines do, and the prefill-leg field contract (``prefill_leg``).
No engine code here: every layer may import this one."""
