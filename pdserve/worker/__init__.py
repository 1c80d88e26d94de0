"""What runs on one device: the model runner (forward pass over the scheduled tokens), the
sampler, the KV-cache tensors and their sizing, and the KV connector's data plane beside them.

Where the worker runs is the executor's choice, by name (``executors``): ``uniproc`` runs it inside the
EngineCore process; ``multiproc`` runs it in worker processes of its own (``process``, one per
tensor-parallel rank), sending each step's changes over ZMQ (``step``). ``interface`` is everything that
crosses between core and worker each step, whichever executor carries it.
"""
