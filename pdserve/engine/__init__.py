"""Everything that runs in the EngineCore process: requests and sampling parameters, block
hashes, the block pool and prefix cache, the KV-cache manager, the scheduler (its settings
``scheduler_config``, its report ``stats``) and its ledger of KV transfers (``remote_kv``), EngineCore,
the core process's loop and its KV-event publisher; the engine's settings (``engine_args``, torch-free,
read by the API process too) and the composition root that builds an engine from them (``build``). The
one place request state lives. No HTTP and no model tensors: the model runs in ``pdserve.worker``,
driven through ``ModelExecutor``.

Deliberately empty of imports: the router imports ``pdserve.engine.block_hash`` alone and must
not pay for (or depend on) the rest of the engine.
"""
