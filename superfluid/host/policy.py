"""How the scheduler spends the engine: the Host's scheduling settings, in one frozen value
(each setting's meaning is documented on Host and in docs/host.md)."""

from __future__ import annotations

from dataclasses import dataclass

from superfluid.host.churn import Churn


@dataclass(frozen=True)
class Policy:
    """How the scheduler spends the engine (see Host for each setting's meaning)."""

    prefill_budget: int = 512
    first_token_target: float | None = 1.0
    decode_step_target: float | None = 0.5
    arrival_wait: float | None = None
    checkpoint_tokens: int = 256
    publish_tokens: int = 256
    on_context_full: str = "error"
    decode_reserve: int = 64
    idle_park_seconds: float | None = 5.0
    max_waiting: int | None = None
    max_wait_seconds: float | None = None
    watermarks: tuple[float, float] = (0.9, 0.75)
    max_pinned_fraction: float = 0.5
    max_sessions: int | None = 1_000_000
    session_expiry_seconds: float | None = None
    stream_interval: float = 0.02
    churn: Churn | None = None  # a test mode: KV moved at every tick on purpose (superfluid/host/churn.py)
