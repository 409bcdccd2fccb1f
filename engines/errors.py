"""Errors the engine adapters raise. Messages say what to change."""


class EngineError(Exception):
    """Base class of every engine adapter error."""


class RuntimeUnavailable(EngineError):
    """The runtime's library is missing, of an untested version, or cannot run on this machine."""


class OptionError(EngineError, ValueError):
    """A runtime option has a bad value, or a combination the runtime refuses."""


class ModelLoadError(EngineError):
    """The model file could not be loaded."""


class IdentityMismatch(EngineError):
    """Pool state written under one engine configuration, offered to another."""


class StateError(EngineError):
    """Pool state that is corrupt, truncated, or does not fit this engine's layout."""


class NoRoom(EngineError):
    """The engine's own KV cache has no room for what was asked (cells, sequences)."""


class WrongThread(EngineError):
    """An engine was called from a thread other than the one that owns it."""


class Interrupted(EngineError):
    """A step was stopped early by `interrupt()`; the sequences hold what it finished."""
