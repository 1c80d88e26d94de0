"""The bottom layer, shared by engines, router, operator and CLI: request/response schemas, errors
and SSE framing (``protocol``), the HTTP toolkit (``http``), tokenizer / chat-template helpers
(``tokenizer``, ``chat``) so the router tokenizes exactly as engines do, the prefill-leg field contract
(``prefill_leg``), the roles (``roles``), flags declared by settings (``flags``), registry rows
(``registry``), the deployment's keys and signatures (``keys``, ``auth``), and the KV-event, frame,
report and OpenAPI formats. No engine code here: every layer may import this one."""
