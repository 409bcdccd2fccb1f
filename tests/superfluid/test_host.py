"""Host and Session on both engines (tiny f32 models built at test time, real shared memory)."""

import asyncio
import threading
import time

import pytest

from superfluid import ContextFull, SessionBusy, SessionNotFound
from superfluid.host.chat import CHATML, ChatTemplate
from superfluid.host.planner import MIN_PREFILL_CHUNK
from tests.conftest import in_threads

PROMPT = "The capital of France is Paris. The quick brown fox"


def generated(session, **kwargs):
    generation = session.generate(**kwargs)
    pieces = list(generation)
    assert "".join(p.text for p in pieces) == generation.text
    return generation


def test_generate_streams_and_commits_what_it_streams(open_host):
    host = open_host()
    s = host.session()
    s.append_text(PROMPT)
    prompt = s.tokens
    generation = generated(s, max_tokens=12)
    assert generation.finish_reason == "length" and len(generation.tokens) == 12
    assert s.tokens == prompt + generation.tokens
    assert generation.prompt_tokens == len(prompt) and generation.cached_tokens == 0
    again = host.session()
    again.append_text(PROMPT)
    assert generated(again, max_tokens=12).tokens == generation.tokens  # greedy, same tokens


def test_chat_turns_are_rendered_by_the_models_template(open_host):
    host = open_host()
    s = host.session(system="You are terse.")
    s.append_user("What is the capital of France?")
    template = ChatTemplate(CHATML)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]
    assert s.detokenize(s.tokens) == template.render(messages)
    reply = s.complete(max_tokens=6)
    assert s.messages == [*messages, {"role": "assistant", "content": reply}]
    s.append_user("And Spain?")
    rendered = s.detokenize(s.tokens)
    assert rendered.endswith("<|im_end|>\n<|im_start|>user\nAnd Spain?<|im_end|>\n")
    assert rendered.startswith(template.render(messages, generation_prompt=True))


def test_many_messages_appended_at_once_are_rendered_once_and_few_as_one_at_a_time(open_host):
    host = open_host()
    few = [("user", "Hi"), ("assistant", "Hello"), ("user", "How are you?")]
    batched, one_by_one = host.session(system="Be brief."), host.session(system="Be brief.")
    host.call(host.commands.append_messages, batched.id, few)
    for role, content in few:
        one_by_one.append_message(role, content)
    assert batched.tokens == one_by_one.tokens and batched.messages == one_by_one.messages
    template = host.call(host.commands.template)
    # (within the 2,048 tokens one session holds on the tiny model: an append past it is refused)
    many = [("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(100)]
    before = template.messages_rendered
    host.call(host.commands.append_messages, batched.id, many)
    # the 4 messages it had, then all 104 once: never once per message (which would be ~5,000)
    assert template.messages_rendered - before == 4 + 104
    whole = [{"role": "system", "content": "Be brief."}] + [{"role": r, "content": c} for r, c in few + many]
    assert batched.detokenize(batched.tokens) == template.render(whole) and batched.messages == whole
    assert batched.info().messages == 104


def test_a_fork_copies_no_kv_bytes_and_goes_its_own_way(open_host):
    host = open_host()
    s = host.session(temperature=0.9, seed=5)
    s.append_text(PROMPT)
    s.complete(max_tokens=4)
    before = host.stats()
    child = s.fork()
    assert host.stats().bytes_copied == before.bytes_copied and child.tokens == s.tokens
    child.append_text(" and then")
    child_reply = generated(child, max_tokens=8)
    parent_reply = generated(s, max_tokens=8)
    lone = host.session(temperature=0.9, seed=5)
    lone.append_tokens(s.tokens[:-8])
    assert generated(lone, max_tokens=8).tokens == parent_reply.tokens  # same seed, same positions
    assert child_reply.cached_tokens > 0 and child.info().parent == s.id


def test_sessions_sharing_a_long_prefix_prefill_it_once(open_host, runtime):
    host = open_host(prefill_budget=256)
    words = " ".join(f"w{i}" for i in range(400))
    sessions = []
    for i in range(8):
        s = host.session()
        s.append_text(words)
        sessions.append(s)
    prefix = len(sessions[0].tokens)
    assert prefix >= 512
    for i, s in enumerate(sessions):
        s.append_text(f" question {i}:")
    generations = [s.generate(max_tokens=4) for s in sessions]
    replies = [g.collect() for g in generations]
    stats = host.stats()
    suffixes = sum(len(s.tokens) - prefix - 4 for s in sessions)
    # The prefix once, each suffix once. A session that waited for another to prefill the prefix
    # starts once that lane is within MIN_PREFILL_CHUNK of it, and prefills those few tokens
    # itself: where that lane's chunks end follows the tick, so the machine's speed.
    slack = MIN_PREFILL_CHUNK * (len(sessions) - 1)
    assert stats.prefill_tokens <= prefix + suffixes + slack, stats
    lone = open_host(pool_name=f"lone-{runtime}-{id(host)}", log_dir=host._log.directory.parent / "lone")
    for s, reply in zip(sessions, replies):
        alone = lone.session()
        alone.append_tokens(s.tokens[:-4])
        assert alone.complete(max_tokens=4) == reply


def test_a_busy_session_refuses_a_second_generation(open_host):
    host = open_host()
    s = host.session()
    s.append_text(PROMPT)
    first = s.generate(max_tokens=100_000, ignore_eos=True)  # still running whatever the machine's load
    with pytest.raises(SessionBusy, match="is generating"):
        s.generate(max_tokens=5)
    with pytest.raises(SessionBusy):
        s.append_text("more")
    first.cancel()
    first.collect()
    assert first.finish_reason == "cancelled"
    assert host.stats().generating == 0
    s.append_text(" more")  # free again
    assert generated(s, max_tokens=2).finish_reason == "length"


def test_a_generation_that_times_out_keeps_what_it_made(open_host, clock):
    host = open_host()
    s = host.session()
    s.append_text(PROMPT)
    generation = s.generate(max_tokens=100_000, timeout=0.3, ignore_eos=True)
    next(generation)
    clock.advance(0.5)
    with pytest.raises(TimeoutError, match="ran past its timeout"):
        generation.collect()
    assert generation.finish_reason == "timeout" and s.tokens[-len(generation.tokens):] == generation.tokens


def test_a_lane_idle_past_the_timer_is_parked_and_its_next_turn_resumes_exactly(open_host, clock):
    host = open_host()
    s = host.session(temperature=0.0)
    s.append_text(PROMPT)
    s.complete(max_tokens=6)
    assert host.stats().lanes == 1
    clock.advance(4.9)  # under idle_park_seconds (5 by default): still warm
    assert host.stats().lanes == 1 and host.stats().idle_parks == 0
    clock.advance(0.2)
    wait_until(lambda: host.stats().lanes == 0)  # the scheduler's idle loop parks it
    parked = host.stats()
    assert parked.idle_parks == 1 and parked.parked_sessions == 1
    held = len(s.tokens) - 1  # the last token sampled was never fed
    s.append_text(" and then")
    resumed = generated(s, max_tokens=8, temperature=0.0)
    assert host.stats().imports == parked.imports + 1 and resumed.cached_tokens == held
    warm = host.session(temperature=0.0)
    warm.append_tokens(s.tokens[:-8])
    assert generated(warm, max_tokens=8, temperature=0.0).tokens == resumed.tokens


def wait_until(condition, seconds: float = 60.0) -> None:
    """Wait for `condition()` to hold (checked every 10 ms); fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.01)


def test_reaching_the_context_length_is_an_error_naming_it(open_host, runtime):
    options = {"llamacpp_n_ctx": 64} if runtime == "llamacpp" else {}
    host = open_host(**options)
    limit = host.descriptor.context_length
    s = host.session()
    s.append_tokens([5] * (limit - 3))
    generation = s.generate(max_tokens=50)
    with pytest.raises(ContextFull, match=f"reached the context length \\({limit} tokens\\)"):
        generation.collect()
    assert len(s.tokens) == limit and len(generation.tokens) == 3
    with pytest.raises(ContextFull, match="trim it"):
        s.generate()
    s.trim(limit - 10)
    assert len(s.tokens) == limit - 10


def test_a_context_policy_of_stop_ends_quietly(open_host, runtime):
    options = {"llamacpp_n_ctx": 64} if runtime == "llamacpp" else {}
    host = open_host(on_context_full="stop", **options)
    s = host.session()
    s.append_tokens([5] * (host.descriptor.context_length - 2))
    generation = generated(s, max_tokens=50)
    assert generation.finish_reason == "length" and len(generation.tokens) == 2


def test_resuming_after_a_clean_restart_prefills_only_what_is_new(open_host):
    host = open_host()
    s = host.session(temperature=0.7, seed=11)
    s.append_text(PROMPT)
    s.complete(max_tokens=10)
    tokens = s.tokens
    host.close()
    again = open_host()
    resumed = again.session(id=s.id)
    assert resumed.tokens == tokens
    reply = generated(resumed, max_tokens=6)
    assert reply.cached_tokens == len(tokens) - 1 and again.stats().prefill_tokens <= 1
    reference = open_host(pool_name=f"ref-{id(again)}", log_dir=again._log.directory.parent / "ref")
    lone = reference.session(temperature=0.7, seed=11)
    lone.append_tokens(tokens)
    assert generated(lone, max_tokens=6).tokens == reply.tokens


def test_calls_from_many_threads(open_host):
    host = open_host()

    def work(i):
        s = host.session()
        s.append_text(f"{PROMPT} {i}")
        generation = s.generate(max_tokens=5)
        generation.collect()
        return s, generation

    results = in_threads(work, 6)
    assert len(host.sessions()) == 6
    for s, generation in results:  # each thread got its own whole reply, committed to its own session
        assert generation.finish_reason == "length" and len(generation.tokens) == 5
        assert s.tokens[-5:] == generation.tokens and s.detokenize(s.tokens).startswith(PROMPT)


def test_generations_read_in_an_event_loop_match_those_read_in_threads(open_host):
    host = open_host()
    expected = []
    for i in range(3):
        s = host.session()
        s.append_text(f"{PROMPT} {i}")
        expected.append(s.generate(max_tokens=6).collect())

    async def read_all() -> list:
        generations = []
        for i in range(3):
            s = host.session()
            s.append_text(f"{PROMPT} {i}")
            generations.append(s.generate(max_tokens=6))

        async def read(generation) -> str:
            return "".join([piece.text async for piece in generation])

        threads = threading.active_count()
        texts = await asyncio.gather(*(read(g) for g in generations))  # all three at once, on one thread
        assert threading.active_count() == threads
        return [(text, g.text, g.finish_reason, len(g.tokens)) for text, g in zip(texts, generations)]

    for (text, recorded, reason, count), wanted in zip(asyncio.run(read_all()), expected):
        assert text == recorded == wanted and reason == "length" and count == 6


def test_bad_calls_name_the_problem_and_change_nothing(open_host, runtime):
    host = open_host()
    s = host.session()
    with pytest.raises(ValueError, match="priority 'urgent'"):
        host.session(priority="urgent")
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        s.append_tokens([1, 10**6])
    with pytest.raises(ValueError, match="max_tokens=0"):
        s.generate(max_tokens=0)
    with pytest.raises(Exception, match="holds no tokens"):
        s.generate()
    with pytest.raises(SessionNotFound, match="no session 'nope'"):
        host.session(id="nope")
    with pytest.raises(ValueError, match=r"trim\(5\)"):
        s.trim(5)
    assert s.tokens == [] and len(host.sessions()) == 1
    host.delete(s.id)
    assert host.sessions() == []
    other = "mlx" if runtime == "llamacpp" else "llamacpp"
    with pytest.raises(ValueError, match=f"option {other}_threads is for the {other} runtime"):
        open_host(pool_name="unused", **{f"{other}_threads": 2})
