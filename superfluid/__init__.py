"""superfluid: local LLM engines hosted in the application's process, around a shared-memory KV pool."""

from superfluid.errors import (ChatError, ContextFull, GenerationTimeout, HostClosed, LogCorrupt, Overloaded, PinLimit,
                               SessionBusy, SessionNotFound, SuperfluidError)
from superfluid.host import Host
from superfluid.sampling import Sampling
from superfluid.session import Generation, Piece, Session, SessionInfo

__version__ = "0.1.0"
__all__ = ["ChatError", "ContextFull", "Generation", "GenerationTimeout", "Host", "HostClosed", "LogCorrupt", "Overloaded",
           "Piece", "PinLimit",
           "Sampling", "Session", "SessionBusy", "SessionInfo", "SessionNotFound", "SuperfluidError"]
