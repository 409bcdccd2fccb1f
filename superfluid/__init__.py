"""superfluid: local LLM engines hosted in the application's process, around a shared-memory KV pool."""

__version__ = "0.1.0"
