"""KV transfer between engines (prefill/decode disaggregation).

- ``base``: the connector interfaces: the scheduler side's hooks, the worker side's protocol, and
  what the worker side reports each step; ``connectors``: the connectors by name (``--kv-connector``);
- ``connector``: the P/D connector's scheduler side, routing each hook to ``prefill_side`` (hold a
  finished prefill leg's blocks for a decode engine) or ``decode_side`` (pull a prompt's blocks
  from a prefill engine); each reads top to bottom as the life of a request in that role;
- ``work``: the work order those sides hand the transfer agent each step;
- ``agent``: the transfer agent, one thread per engine owning the side channel, holds, leases,
  handshakes and pulls, and ``make_transfer_agent``; its prefill side, the held blocks and the serving
  of the side channel, in ``holds``; its decode side, the pulls (each a small state machine), their
  handshakes and lease renewals, in ``pulls``, over the connections of ``peers``; ``transport``: the
  data planes, NIXL (default) and TCP, one module each, by name in ``transport.registry``;
  ``nixl_policy``: where NIXL may serve; ``admission``: the side channel's connection caps;
  ``messages``: the side channel's sealed frames;
- ``layout``: tensor-parallel engines: which KV heads each rank holds, which prefill rank each
  decode rank reads them from; ``aggregate``: every rank's agent reports joined into the engine's;
- ``params``: ``kv_transfer_params`` (vLLM's field names plus ours); ``config``: settings and the
  fault-injection hook the tests use.
"""
