"""Limits with names: a cap on sessions, on messages in one request, and an idle expiry that is
off by default and never takes a pinned session. Each refusal names the limit and what to change,
and leaves everything else as it was."""

import time

import pytest

from superfluid import SessionNotFound
from superfluid.host.errors import TooManyMessages, TooManySessions
from superfluid.host.request import Prompt


def test_a_session_past_the_cap_is_refused_and_a_deleted_one_makes_room(open_host):
    host = open_host(max_sessions=2)
    first, second = host.session(), host.session()
    with pytest.raises(TooManySessions, match="holds 2 sessions, its max_sessions"):
        host.session()
    with pytest.raises(TooManySessions):
        first.fork()
    assert host.stats().sessions == 2
    host.delete(second.id)
    host.session()  # room again
    assert host.stats().sessions == 2


def test_a_request_or_append_past_the_message_cap_is_refused_before_anything_is_rendered(open_host):
    host = open_host(max_messages=3)
    messages = tuple(("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(4))
    with pytest.raises(TooManyMessages, match="4 messages in one request; this host takes at most 3"):
        host.prepare(Prompt(messages=messages))
    session = host.session()
    with pytest.raises(TooManyMessages):
        host.append_messages(session.id, messages)
    assert session.messages == [] and session.tokens == []
    host.append_messages(session.id, messages[:3])  # at the cap is fine
    assert len(session.messages) == 3


def idle_rounds_until(host, done) -> None:
    """Let the host's idle rounds run until `done()` (each round looks at the test's clock)."""
    deadline = time.monotonic() + 60
    while not done() and time.monotonic() < deadline:
        host.stats()  # a command: a round of the scheduler's loop
        time.sleep(0.01)


def test_sessions_idle_past_the_expiry_go_and_pinned_or_recently_changed_ones_stay(open_host, clock):
    host = open_host(session_expiry_seconds=10)
    idle, pinned, busy = host.session(), host.session(), host.session()
    for session in (idle, pinned, busy):
        session.append_text("The capital of France is")
    pinned.complete(max_tokens=2)
    pinned.pin()
    clock.advance(6)
    busy.append_text(" Paris")  # a change: its idle time starts again
    clock.advance(5)
    idle_rounds_until(host, lambda: host.stats().expired_sessions >= 1)
    assert host.stats().expired_sessions == 1
    with pytest.raises(SessionNotFound):
        host.session(id=idle.id)
    assert host.session(id=pinned.id).tokens and host.session(id=busy.id).tokens
    clock.advance(10)
    idle_rounds_until(host, lambda: host.stats().expired_sessions >= 2)
    assert host.stats().expired_sessions == 2 and host.session(id=pinned.id).tokens  # pinned: never


def test_without_an_expiry_no_session_goes(open_host, clock):
    host = open_host()
    session = host.session()
    session.append_text("Hello")
    clock.advance(10 ** 9)
    host.stats()
    assert host.session(id=session.id).tokens and host.stats().expired_sessions == 0
