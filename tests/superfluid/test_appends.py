"""Messages appended to a session are rendered and tokenized on the caller's thread: the scheduler
thread only checks that the session did not change meanwhile and commits the tokens."""

import pytest

from superfluid import ChatError, ContextFull, SessionNotFound
from superfluid.host import host as host_module
from tests.superfluid.test_chat_templates import DROPS_PAST_REASONING

TURNS = [("system", "Be brief."), ("user", "Hello there"), ("assistant", "Hi!"), ("user", "How are you?")]


def scheduler_renders(host) -> int:
    """Messages the scheduler thread's own chat template has rendered so far."""
    return host.call(lambda: host.commands.sessions.template().messages_rendered)


def on_the_scheduler_thread(host, messages):
    """A session with `messages` appended the old way: rendered on the scheduler thread."""
    session = host.session()
    host.call(host.commands.append_messages, session.id, messages)
    return host.call(lambda: host.commands.sessions.get(session.id).state)


def state_of(host, session):
    return host.call(lambda: host.commands.sessions.get(session.id).state)


def test_appended_messages_are_rendered_on_the_callers_thread_into_the_same_tokens(open_host):
    host = open_host()
    reference = on_the_scheduler_thread(host, TURNS)
    before, caller = scheduler_renders(host), host.prompts.template.messages_rendered
    session = host.session()
    for role, content in TURNS:
        session.append_message(role, content)
    state = state_of(host, session)
    assert scheduler_renders(host) == before and host.prompts.template.messages_rendered > caller
    assert (state.tokens, state.message_ends, state.messages) == (reference.tokens, reference.message_ends,
                                                                   reference.messages)
    many = [("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(20)]  # past 8: rendered at once
    host.append_messages(session.id, many)
    assert scheduler_renders(host) == before
    assert state_of(host, session).message_ends[-20:] == [len(state_of(host, session).tokens)] * 20


def test_a_session_that_changes_while_its_message_renders_is_rendered_again(open_host, monkeypatch):
    host = open_host()
    session = host.session()
    session.append_message("user", "Hello there")
    rendered = []
    real = host_module.appended_pieces

    def meanwhile(template, tokenize, before, added, tools):  # another thread appends as this one renders
        if not rendered:
            host.call(host.commands.append_messages, session.id, [("assistant", "Hi!")])
        rendered.append(len(before))
        return real(template, tokenize, before, added, tools)

    monkeypatch.setattr(host_module, "appended_pieces", meanwhile)
    session.append_message("user", "How are you?")
    monkeypatch.undo()
    assert rendered[0] == 1 and rendered[-1] == 2  # rendered again against the changed session
    reference = on_the_scheduler_thread(host, [("user", "Hello there"), ("assistant", "Hi!"), ("user", "How are you?")])
    assert state_of(host, session).tokens == reference.tokens


def test_a_session_that_keeps_changing_is_rendered_on_the_scheduler_thread(open_host, monkeypatch):
    host = open_host()
    session = host.session()
    real = host_module.appended_pieces

    def always(template, tokenize, before, added, tools):
        host.call(host.commands.append_text, session.id, " and")  # changes every time: never current
        return real(template, tokenize, before, added, tools)

    monkeypatch.setattr(host_module, "appended_pieces", always)
    before = scheduler_renders(host)
    session.append_message("user", "Hello there")
    assert scheduler_renders(host) > before  # after OPTIMISTIC_TRIES, rendered where it cannot go stale
    state = state_of(host, session)
    assert [m["content"] for m in state.messages] == ["Hello there"] and state.message_ends == [len(state.tokens)]


def test_a_template_that_rewrites_earlier_turns_renders_on_the_scheduler_thread(template_host):
    host = template_host(DROPS_PAST_REASONING)
    session = host.session()
    session.append_message("user", "Hello there")
    session.append_message("assistant", "<think>long reasoning</think>Hi!")
    before = scheduler_renders(host)
    session.append_message("user", "How are you?")  # drops the reasoning above: rendered whole, on the thread
    assert scheduler_renders(host) > before
    state = state_of(host, session)
    assert [m["content"] for m in state.messages][-1] == "How are you?" and len(state.messages) == 3
    whole = host.call(lambda: host.commands.engine.tokenize(host.prompts.template.render(state.messages), special=True))
    assert state.tokens == whole  # the session holds what the whole conversation renders


def test_bad_appends_change_nothing(open_host):
    host = open_host()
    session = host.session()
    session.append_message("user", "Hello there")
    tokens = state_of(host, session).tokens[:]
    with pytest.raises(ChatError):
        session.append_message("wizard", "abracadabra")
    with pytest.raises(SessionNotFound):
        host.append_messages("no-such-session", [("user", "Hi")])
    assert state_of(host, session).tokens == tokens


def test_an_append_past_what_one_session_holds_is_refused_and_appends_nothing(open_host):
    # A session grown past the context would make its next fork, compaction or generation write
    # or need what no start can read back: the append is refused whole, before any record.
    host = open_host()
    limit = host.call(host.commands.scheduler.context_limit)
    session = host.session()
    session.append_message("user", "Hello there")
    before = state_of(host, session)
    held = len(before.tokens)
    with pytest.raises(ContextFull, match=rf"holds {held} tokens; appending {limit + 1 - held} tokens would pass"):
        session.append_tokens([1] * (limit + 1 - held))
    with pytest.raises(ContextFull, match="appending 1 message"):
        session.append_message("assistant", "word " * limit)
    with pytest.raises(ContextFull, match="appending 2 message"):
        host.call(host.commands.append_messages, session.id, [("assistant", "Hi"), ("user", "word " * limit)])
    after = state_of(host, session)
    assert (after.tokens, after.messages) == (before.tokens, before.messages)
    session.append_tokens([1] * (limit - held))  # up to the limit itself is room
    assert len(session.tokens) == limit
