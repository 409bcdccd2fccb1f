"""Engine adapters: one per runtime, speaking superfluid's small Engine protocol.

`engines.registry` maps runtime ids to adapters; each adapter lives in its own package
(`engines.llamacpp`, ...) and uses `kvpool` only for its types.
"""
