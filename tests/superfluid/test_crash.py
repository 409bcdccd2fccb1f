"""SIGKILL in the middle of a generation, then a new Host: nothing committed is lost, and only the
tokens since the last checkpoint are prefilled again."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_a_killed_host_resumes_every_session_at_its_last_committed_token(open_host, runtime, model_for, tmp_path):
    name = f"crash-{os.getpid()}-{runtime}"
    child = subprocess.Popen([sys.executable, "-m", "tests.superfluid.crash_host", str(model_for(runtime)), runtime,
                              name, str(tmp_path / "log")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        _, session_id, prompt = child.stdout.readline().split()
        reported = []
        while len(reported) < 40:
            line = child.stdout.readline()
            assert line.startswith("token "), f"the child ended early: {line!r}"
            reported.append(int(line.split()[1]))
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    host = open_host(pool_name=name)  # the same pool and log
    session = host.session(id=session_id)
    tokens = session.tokens
    start = int(prompt)
    assert tokens[start:start + len(reported)] == reported  # every reported token was committed
    parked = session.info().parked_tokens
    assert parked >= 16, "a checkpoint every 16 tokens must have parked something"
    generation = session.generate(max_tokens=3)
    generation.collect()
    assert generation.cached_tokens == parked  # re-attached from the surviving segment
    assert host.stats().prefill_tokens == len(tokens) - parked  # only what came after the checkpoint
    assert len(tokens) - parked <= 16 + 1


def test_after_a_reboot_a_session_resumes_from_the_disk_tier(open_host, runtime):
    from tests.conftest import remove_segment

    name = f"crash-reboot-{os.getpid()}-{runtime}"
    host = open_host(pool_name=name, checkpoint_tokens=8)
    session = host.session()
    session.append_text("The capital of France is Paris.")
    session.complete(max_tokens=20)
    tokens, parked = session.tokens, session.info().parked_tokens
    host.close()  # parks every lane; the disk tier writes what is queued before it closes
    remove_segment(name)  # the machine rebooted: shared memory is gone, the disk is not
    again = open_host(pool_name=name)
    again.pool.disk.wait_scanned(30)
    resumed = again.session(id=session.id)
    generation = resumed.generate(max_tokens=2)
    generation.collect()
    # close parked the whole lane (past the last checkpoint): all of it came back but the last
    # token, whose logits the next step needs
    assert generation.cached_tokens == len(tokens) - 1 > parked
    stats = again.stats()
    assert stats.prefill_tokens == 1 and stats.tiers["disk"].hits == 1 and stats.tiers["memory"].misses == 1
    assert stats.tiers["disk"].bytes_read > 0 and stats.tiers["memory"].bytes_written >= stats.tiers["disk"].bytes_read


def test_without_the_segment_or_a_disk_tier_the_log_is_prefilled_again(open_host, runtime):
    from tests.conftest import remove_segment

    name = f"crash-gone-{os.getpid()}-{runtime}"
    host = open_host(pool_name=name, checkpoint_tokens=8, disk_tier=False)
    session = host.session()
    session.append_text("The capital of France is Paris.")
    session.complete(max_tokens=20)
    tokens = session.tokens
    host.close()
    remove_segment(name)  # the machine rebooted: shared memory is gone
    again = open_host(pool_name=name, disk_tier=False)
    resumed = again.session(id=session.id)
    assert resumed.tokens == tokens
    generation = resumed.generate(max_tokens=2)
    generation.collect()
    assert generation.cached_tokens == 0 and again.stats().prefill_tokens == len(tokens)
    assert again.pool.disk is None and set(again.stats().tiers) == {"memory"}


def test_a_log_damaged_in_the_middle_keeps_the_host_from_starting_and_says_what_to_do(open_host, tmp_path):
    from superfluid import LogCorrupt

    host = open_host()
    s = host.session()
    s.append_text("The capital of France is Paris.")
    s.complete(max_tokens=4)
    log_path = host._log.path
    host.close()
    data = bytearray(log_path.read_bytes())
    data[20] ^= 0xFF  # inside the first record
    log_path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=r"damaged at byte 8 .*superfluid log repair"):
        open_host()
    assert log_path.read_bytes() == bytes(data)  # replay guessed nothing and cut nothing


def test_a_torn_last_record_is_cut_and_the_host_starts(open_host):
    host = open_host()
    s = host.session()
    s.append_text("The capital of France is Paris.")
    tokens = s.tokens
    log_path = host._log.path
    host.close()
    with open(log_path, "ab") as handle:
        handle.write(b"\x40\x00\x00\x00" + b"\x00" * 10)  # a frame whose write was cut short
    again = open_host()
    assert again.session(id=s.id).tokens == tokens and again._log.truncated_bytes == 14


def test_an_assistant_reply_begun_raw_by_the_application_is_never_closed_as_a_turn_left_open(open_host):
    # only a turn a generation opened is closed: the application's own opening and words (to
    # have the model go on from them) stay as they are, at its next command and after a restart
    host = open_host()
    session = host.session()
    session.append_user("Name a colour.")
    sessions = host.commands.sessions
    opening = host.call(lambda: sessions.opening(sessions.get(session.id)))
    begun = [*opening, *host.call(lambda: sessions.engine.tokenize("Sure, ", special=False))]
    session.append_tokens(begun)
    session.trim(len(session.tokens))  # an idle command: the host settles what it owes first
    assert [m["role"] for m in session.messages] == ["user"] and session.tokens[-len(begun):] == begun
    host.close()
    again = open_host()
    resumed = again.session(id=session.id)
    assert [m["role"] for m in resumed.messages] == ["user"] and resumed.tokens[-len(begun):] == begun
    assert again.call(lambda: again.commands.sessions.turns_closed) == 0


def test_a_turn_a_kill_left_open_is_closed_at_recovery_and_the_conversation_goes_on(open_host, runtime, model_for,
                                                                                      tmp_path):
    name = f"crash-chat-{os.getpid()}-{runtime}"
    child = subprocess.Popen([sys.executable, "-m", "tests.superfluid.crash_host", str(model_for(runtime)), runtime,
                              name, str(tmp_path / "log"), "chat"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        _, session_id, _ = child.stdout.readline().split()
        for _ in range(10):
            assert child.stdout.readline().startswith("token ")
        child.send_signal(signal.SIGKILL)  # between two tokens: no record closes the assistant's turn
    finally:
        child.kill()
        child.wait()
    host = open_host(pool_name=name)
    session = host.session(id=session_id)
    messages = session.messages
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"]
    assert host.call(lambda: host.commands.sessions.turns_closed) == 1
    # the session holds what its conversation renders to, as if the reply had ended there
    rendered = host.call(lambda: host.commands.sessions.template().render(messages))
    assert session.detokenize(session.tokens) == rendered
    session.append_user("And then?")
    session.complete(max_tokens=2)
    assert [m["role"] for m in session.messages] == [
        "user", "assistant", "user", "assistant"]


def test_recovery_closes_an_open_turn_on_a_template_that_requires_alternating_roles(tmp_path):
    from superfluid import Host
    from tests import realtemplates, tinymodels
    from tests.conftest import remove_segment, unique_pool_name

    model = tinymodels.build(tmp_path / "model", "f32", chat_template=realtemplates.from_llama_cpp()["Gemma 2"])
    pool = unique_pool_name()

    def open_it():
        return Host(model.gguf, pool_name=pool, pool_bytes=32 << 20, log_dir=tmp_path / "log", llamacpp_threads=2,
                    llamacpp_n_ctx=2048)

    try:
        host = open_it()
        session = host.session()
        session.append_user("Hello")

        def crash_mid_reply():  # what a kill leaves: the opening and three reply tokens, no closing
            sessions = host.commands.sessions
            live = sessions.get(session.id)
            sessions.commit(live, sessions.opening(live), opens_turn=True)  # as a generation opens it
            sessions.commit(live, [40, 41, 42])

        host.call(crash_mid_reply)
        host.close()
        host = open_it()
        session = host.session(id=session.id)
        assert [m["role"] for m in session.messages] == ["user", "assistant"]
        session.append_user("Go on")  # roles alternate: the template takes it
        session.complete(max_tokens=2)
        host.close()
    finally:
        remove_segment(pool)


@pytest.mark.parametrize("runtime", ["llamacpp"])  # the log's records, not the engine
def test_a_fork_of_a_session_mid_reply_keeps_the_turn_open_and_closes_it_at_its_first_command(open_host):
    host = open_host()
    parent = host.session()
    parent.append_user("Hello")
    sessions = host.commands.sessions

    def mid_reply():  # what a generation has written three tokens into its reply
        live = sessions.get(parent.id)
        sessions.commit(live, sessions.opening(live), opens_turn=True)
        sessions.commit(live, [40, 41, 42])

    host.call(mid_reply)
    child = parent.fork()
    child.append_user("Go on")
    assert [m["role"] for m in child.messages] == ["user", "assistant", "user"]
