"""Errors the host raises. Each message says what went wrong and what to change."""


class SuperfluidError(Exception):
    """Base class of the host's errors."""


class ChatError(SuperfluidError, ValueError):
    """Messages the model's chat template cannot render, or a template that cannot grow a turn at a time."""


class SessionNotFound(SuperfluidError, KeyError):
    """No session of that id (never created, or deleted)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class SessionBusy(SuperfluidError):
    """The session is already generating; one generation at a time per session."""


class EmptySession(SuperfluidError, ValueError):
    """A generation was asked of a session that holds no tokens: there is nothing to continue."""


class TooManySessions(SuperfluidError):
    """The host holds `max_sessions` sessions: delete some (or raise the cap) before creating more."""


class TooManyMessages(SuperfluidError, ValueError):
    """A prompt or an append brought more messages than `max_messages`."""


class ContextFull(SuperfluidError):
    """A session reached the engine's context length."""


class LogCorrupt(SuperfluidError):
    """The session log is damaged in a way replay must not guess about."""


class LogBusy(SuperfluidError):
    """Another Host (in this process or another) holds the session log directory."""


class PinLimit(SuperfluidError):
    """Pinning a session's KV would pass the host's cap on pinned bytes."""


class HostClosed(SuperfluidError):
    """The host was closed (or its scheduler stopped after an error)."""


class GenerationTimeout(SuperfluidError, TimeoutError):
    """A generation ran past its timeout; what it produced so far was kept."""


class Overloaded(SuperfluidError):
    """More generations are waiting for the engine than the host queues (max_waiting), or one
    waited past max_wait_seconds before it could start; nothing of it was generated. Retry after
    `retry_after` seconds, or raise the limit."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
