"""The engine core shared by the prefill, decode and colocated roles: requests, sampling
parameters, the block pool and prefix cache, the KV-cache manager, the scheduler and EngineCore.

Deliberately empty of imports: the router imports ``pdserve.engine.block_hash`` alone and must
not pay for (or depend on) the rest of the engine.
"""
