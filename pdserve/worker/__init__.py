"""What runs on one device: the model runner (forward pass over the scheduled tokens), the
sampler, the KV-cache tensors and their sizing, and the KV connector's data plane beside them.

Today the worker runs inside the EngineCore process (one device). ``interface`` is everything
that crosses between core and worker each step, so moving workers into processes of their own
changes the transport, not these modules.
"""
