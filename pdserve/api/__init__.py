"""The OpenAI-facing protocol layer shared by engines and router: tokenizer and chat-template
helpers (so the router tokenizes exactly as engines do); request/response schemas come with the
HTTP server."""
