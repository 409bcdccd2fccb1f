"""A write error (a full disk, an I/O error) ends only the generations whose records it touches,
with an error naming the cause; the host stays up, and writes resume when the disk takes them."""

import errno

import pytest

from superfluid.host.log import Deleted, LogWriteFailed
from superfluid.host.request import GenerateRequest, Prompt
from tests.gate import Gate, decode_steps_of


class FullDisk:
    """The host's log writes fail with ENOSPC while `full` is set."""

    def __init__(self, log) -> None:
        self.full, self.refused = False, 0
        self._write = log._write

        def write(blob: bytes) -> None:
            if self.full:
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            self._write(blob)
        log._write = write


def test_a_full_disk_ends_the_generations_it_touches_and_the_host_goes_on(open_host):
    gate = Gate(decode_steps_of(1, 3))  # the disk fills mid-generation, whatever the machine's speed
    host = open_host(gate=gate)
    disk = FullDisk(host._log)
    chat = host.session()
    chat.append_user("Tell me about Paris.")
    generation = chat.generate(max_tokens=40, ignore_eos=True)
    gate.wait_reached()
    disk.full = True
    gate.open()
    with pytest.raises(LogWriteFailed, match="could not be written .*No space left on device"):
        generation.collect()
    assert disk.refused >= 1 and len(generation.tokens) == 3  # the tokens written before the disk filled
    # a one-shot request writes no records: it is served while the disk is full
    prompt = host.prepare(Prompt(messages=(("user", "Hi"),)))
    _, request = host.call(host.commands.start_request, prompt, GenerateRequest(max_tokens=4, ignore_eos=True))
    request.collect()
    assert len(request.tokens) == 4
    with pytest.raises(OSError):  # an append is refused whole while the disk is full
        chat.append_user("And then?")
    disk.full = False  # space came back: writes resume
    chat.append_user("And then?")  # the reply's open turn is closed first: the roles alternate
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user"]
    assert chat.messages[1]["content"]
    chat.complete(max_tokens=3, ignore_eos=True)
    assert chat.messages[-1]["role"] == "assistant" and len(chat.messages) == 4 and host.alive()
    kept = chat.tokens
    host.close()
    again = open_host()
    assert again.session(id=chat.id).tokens == kept  # what the host held is what the log holds


def test_every_generation_sharing_a_failed_write_is_told(open_host):
    gate = Gate(decode_steps_of(3, 2))  # all three mid-generation when the disk fills
    host = open_host(gate=gate)
    disk = FullDisk(host._log)
    sessions = [host.session() for _ in range(3)]
    for session in sessions:
        session.append_text("The capital of France is")
    generations = [session.generate(max_tokens=100_000, ignore_eos=True) for session in sessions]  # (all overlap)
    gate.wait_reached()
    disk.full = True
    gate.open()
    for generation in generations:
        with pytest.raises(LogWriteFailed):
            generation.collect()
    disk.full = False
    for session, generation in zip(sessions, generations):
        assert session.tokens[-len(generation.tokens):] == generation.tokens  # each kept what its reader got


def test_a_failed_batch_puts_every_state_back_as_the_file_has_it(tmp_path):
    from superfluid.host.log import SessionLog
    from superfluid.host.log_records import Opened, Parked, Tokens, Trimmed, Turn
    from superfluid.host.sampling import Sampling

    log = SessionLog(tmp_path)
    log.append(Opened("a", 1.0, Sampling(), "default"), Turn("a", "user", "hi", 3), Tokens("a", 0, [1, 2, 3]),
               Parked("a", 4, 3), Opened("gone", 1.0, Sampling(), "default"))
    before = {sid: (list(s.tokens), list(s.messages), s.parked) for sid, s in log.states.items()}
    size = log.path.stat().st_size
    disk = FullDisk(log)
    disk.full = True
    with pytest.raises(LogWriteFailed) as failed:
        with log.batch():
            log.append(Tokens("a", 3, [4, 5]), Turn("a", "assistant", "x", 5), Parked("a", 9, 5))
            log.append(Trimmed("a", 1), Tokens("a", 1, [7]))
            log.append(Opened("b", 1.0, Sampling(), "default"), Deleted("gone"))
            assert log.states["a"].tokens == [1, 7]  # applied as they come
    assert failed.value.sessions == {"a", "b", "gone"} and failed.value.errno == errno.ENOSPC
    assert {sid: (list(s.tokens), list(s.messages), s.parked) for sid, s in log.states.items()} == before
    assert log.path.stat().st_size == size
    disk.full = False
    log.append(Tokens("a", 3, [8]))  # the numbering goes on as the file has it
    log.close()
    assert SessionLog(tmp_path).states["a"].tokens == [1, 2, 3, 8]


def test_a_generation_cancelled_before_it_ran_on_a_full_disk_leaves_the_host_up(open_host):
    # Its session is cut back to before it asked (a Trimmed record): the disk refuses that too
    host = open_host()
    disk = FullDisk(host._log)
    chat = host.session()
    chat.append_user("Hello")
    before = chat.tokens

    def ask_and_cancel():  # the opening is committed; the generation ends before any step
        generation = host.commands.generate(chat.id, GenerateRequest(max_tokens=4))
        disk.full = True
        generation.cancel()
        return generation

    generation = host.call(ask_and_cancel)
    generation.collect()  # cancelled, before it produced anything
    assert host.alive() and generation.tokens == []
    with pytest.raises(OSError):  # the cut is owed: the session's next command waits for the disk
        chat.complete(max_tokens=2, ignore_eos=True)
    disk.full = False
    chat.complete(max_tokens=2, ignore_eos=True)  # the owed cut first: one assistant turn, not two
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] and chat.tokens[:len(before)] == before
    opening = host.call(lambda: host.commands.sessions.opening(host.commands.sessions.get(chat.id)))
    assert chat.tokens.count(opening[0]) == before.count(opening[0]) + 1  # one opening after the user's turn
