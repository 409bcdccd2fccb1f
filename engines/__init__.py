"""Engine adapters: one per runtime, speaking superfluid's small Engine protocol.

Adapters arrive with the llama.cpp and MLX issues; this package depends on kvpool only.
"""
