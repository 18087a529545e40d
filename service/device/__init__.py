"""The device layer: device pools on the served GPUs, and the copies between them and the host
pool (``tier.DeviceTier``). It takes pinned host entries and returns placements; it never
calls back into the engine, and knows nothing of transports.
"""
