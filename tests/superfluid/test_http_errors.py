"""One table maps every error the host raises to its HTTP answer: a response before a stream
began and an error event inside one say the same status, type and code."""

import pytest

from superfluid.host.chat import TemplateRewrites
from superfluid.host.log import LogWriteFailed
from superfluid.http import api, responses
from superfluid.host.errors import (ChatError, ContextFull, EmptySession, HostClosed, LogCorrupt, Overloaded,
                                    PinLimit, SessionBusy, SessionNotFound, TooManyMessages, TooManySessions)


@pytest.mark.parametrize("error, status, kind, code", [
    (SessionNotFound("no session 'x'"), 404, "not_found_error", "session_not_found"),
    (SessionBusy("session 'x' is generating"), 409, "invalid_request_error", "session_busy"),
    (PinLimit("pinning would pass the cap"), 409, "invalid_request_error", "pin_limit"),
    (ContextFull("session 'x' holds 8192 tokens"), 400, "invalid_request_error", "context_length_exceeded"),
    (ChatError("the chat template refused the conversation"), 400, "invalid_request_error", "chat_template_error"),
    (EmptySession("session 'x' holds no tokens"), 400, "invalid_request_error", "empty_session"),
    (TooManyMessages("5 messages in one request"), 400, "invalid_request_error", "too_many_messages"),
    (TooManySessions("the host holds 9 sessions"), 429, "rate_limit_error", "too_many_sessions"),
    # a subclass is answered as its nearest listed class
    (TemplateRewrites("the template rewrites earlier turns"), 400, "invalid_request_error", "chat_template_error"),
    (Overloaded("64 generations wait", retry_after=3), 503, "server_error", "overloaded"),
    (HostClosed("the host is closed"), 503, "server_error", "shutting_down"),
    (LogWriteFailed({"a"}, OSError(28, "No space left on device")), 507, "server_error", "log_write_failed"),
])
def test_a_response_and_an_event_inside_a_stream_answer_an_error_alike(error, status, kind, code):
    answered, body, _ = responses.error_response(error)
    assert answered == status and body["error"]["type"] == kind and body["error"]["code"] == code
    assert body["error"]["message"] == str(error)
    assert responses.error_event(error) == body


def test_an_overloaded_answer_says_when_to_retry():
    assert responses.error_response(Overloaded("full", retry_after=3))[2] == {"Retry-After": "3"}


def test_an_error_the_table_does_not_know_is_a_500_that_names_it():
    for error in (LogCorrupt("record 7 is torn"), RuntimeError("boom")):
        status, body, headers = responses.error_response(error)
        assert status == 500 and body["error"]["type"] == "server_error" and headers is None
        assert type(error).__name__ in body["error"]["message"] and responses.error_event(error) == body


def test_an_api_error_is_answered_as_it_was_raised():
    error = api.ApiError(422, "max_tokens must be positive", param="max_tokens", code="invalid_value")
    assert responses.error_response(error) == (422, error.body(), None) and responses.error_event(error) == error.body()
