"""Token bytes to showable text: whole characters, stop strings across tokens."""

import pytest

from superfluid.host.stream import TextStream


def feed_all(stream, chunks):
    return [stream.feed(chunk) for chunk in chunks]


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    stream = TextStream()
    snowman = "☃".encode()  # three bytes
    assert feed_all(stream, [b"a", snowman[:1], snowman[1:2], snowman[2:] + b"b"]) == ["a", "", "", "☃b"]
    assert stream.finish() == "" and stream.text == "a☃b"


def test_an_unfinished_character_at_the_end_becomes_a_replacement_character():
    stream = TextStream()
    assert stream.feed("é".encode()[:1]) == ""
    assert stream.finish() == "\ufffd"


def test_a_stop_string_spanning_tokens_is_found_and_never_shown():
    stream = TextStream(stop=["STOP"])
    assert feed_all(stream, [b"Hel", b"lo ", b"ST", b"O"]) == ["Hel", "lo ", "", ""]
    assert stream.feed(b"P and more") == "" and stream.stopped == "STOP"
    assert stream.text == "Hello " and stream.feed(b"x") == "" and stream.finish() == ""


def test_text_that_only_looked_like_a_stop_string_is_released():
    stream = TextStream(stop=["\n\n", "END"])
    assert stream.feed(b"an E") == "an "
    assert stream.feed(b"Ntry") == "ENtry"
    assert stream.feed(b"\n") == ""
    assert stream.feed(b"x") == "\nx"
    assert stream.finish() == "" and stream.stopped is None


def test_the_earliest_of_several_stop_strings_wins():
    stream = TextStream(stop=["b", "abc"])
    assert stream.feed(b"xabc") == "x" and stream.stopped == "abc"  # found at 1, before "b" at 2


def test_a_stop_string_inside_a_multibyte_character_stream():
    stream = TextStream(stop="☃")
    data = "x☃y".encode()
    assert feed_all(stream, [data[:2], data[2:]]) == ["x", ""]
    assert stream.stopped == "☃" and stream.text == "x"


@pytest.mark.parametrize("stop", [[], [""]])
def test_no_stop_strings(stop):
    stream = TextStream(stop)
    assert stream.feed(b"abc") == "abc" and stream.finish() == ""


def test_text_held_for_a_stop_string_is_the_replys_when_an_end_of_turn_token_ends_it(tmp_path):
    """An end-of-turn token while a possible stop string's start is held back: the held text is the
    reply's after all (the stream ends without the stop string)."""
    from superfluid import Host
    from tests.cellengine import CellEngine
    from tests.conftest import remove_segment, unique_pool_name

    def run(eos: tuple[int, ...], stop: list[str], name: str):
        pool = unique_pool_name()
        host = Host("cell-engine", engine_factory=lambda: CellEngine(1024, eos=eos), pool_name=pool,
                    pool_bytes=16 << 20, log_dir=tmp_path / name)
        try:
            session = host.session()
            session.append_tokens([1, 2, 3])
            generation = session.generate(max_tokens=12, stop=stop)
            generation.collect()
            return generation.tokens, generation.text, generation.finish_reason
        finally:
            host.close()
            remove_segment(pool)

    tokens, text, _ = run((), [], "free")
    # the first token that has not appeared before, at least two tokens in: it will end the reply
    end = next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])
    held = text[end - 1]  # the letter before it, which a stop string starting with it holds back
    ended, reply, reason = run((tokens[end],), [held + "!"], "ended")
    assert ended == tokens[:end + 1] and reason == "stop"
    assert reply == text[:end]  # the held letter is not lost
