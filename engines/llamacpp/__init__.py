"""llama.cpp through llama-cpp-python's low-level bindings: see engine.LlamaCppEngine."""
