"""superfluid: local LLM engines hosted in the application's process, around a shared-memory KV pool.

`superfluid` is the one import an application needs: the Host and sessions, and, for driving an
engine and the pool directly, `Pool`, `Budget`, `StepRequest`, `LlamaCppEngine`, `MlxEngine`,
`models` and `transfer` (imported when first used).
"""

from superfluid import parts

parts.check()  # before anything imports `engines` or `kvpool` for real use

from superfluid.host.errors import (ChatError, ContextFull, EmptySession, GenerationTimeout, HostClosed, LogCorrupt,
                                    Overloaded, PinLimit, SessionBusy, SessionNotFound, SuperfluidError,
                                    TooManyMessages, TooManySessions)
from superfluid.host.host import Host
from superfluid.host.log import LogWriteFailed
from superfluid.host.sampling import Sampling
from superfluid.host.session import Generation, Piece, Session, SessionInfo

__version__ = "0.1.0"
DISTRIBUTION = "superfluid-llm"  # PyPI's "superfluid" is another project

# name -> (module, attribute or None for the module itself), imported on first use: the engines
# import their runtimes' bindings only when they are wanted
_LAZY = {"Pool": ("kvpool", "Pool"), "Budget": ("kvpool", "Budget"), "StepRequest": ("engines.base", "StepRequest"),
         "LlamaCppEngine": ("engines.llamacpp.engine", "LlamaCppEngine"),
         "MlxEngine": ("engines.mlx.engine", "MlxEngine"), "models": ("engines.models", None),
         "transfer": ("superfluid.host.transfer", None)}


def __getattr__(name: str):
    """The engine and pool names superfluid re-exports, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module 'superfluid' has no attribute {name!r}")
    import importlib

    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


__all__ = ["ChatError", "ContextFull", "EmptySession", "Generation", "GenerationTimeout", "Host", "HostClosed",
           "LogCorrupt", "LogWriteFailed", "Overloaded", "Piece", "PinLimit", "Sampling", "Session", "SessionBusy",
           "SessionInfo", "SessionNotFound", "SuperfluidError", "TooManyMessages", "TooManySessions", *_LAZY]
