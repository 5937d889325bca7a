"""ElasticMoE decision core: pure, deterministic, IO-free.

Nothing here imports asyncio, grpc, socket, time, global random, `agent` or `dataplane_shim`.
Time arrives as a step or tick argument; randomness as a seeded `numpy.random.Generator`.
"""
