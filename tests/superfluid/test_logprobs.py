"""Token log-probabilities: the model's own distribution at each sampled token, through the Host
on both runtimes and through `superfluid serve` in OpenAI's shapes."""

import numpy as np
import pytest

from superfluid.host.sampling import SamplingError, logprobs
from tests.superfluid.served import Served

PROMPT = "The capital of France is Paris. The quick brown fox"


def log_softmax(row) -> np.ndarray:
    row = np.asarray(row, np.float64)
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def test_logprobs_are_the_softmax_of_the_logits_with_the_most_likely_first():
    logits = np.array([1.0, 3.0, 3.0, -2.0, 0.5])
    scored = logprobs(logits, 3, 3, lambda t: bytes([65 + t]))
    expected = log_softmax(logits)
    assert scored.token == 3 and scored.bytes == b"D" and scored.logprob == pytest.approx(expected[3])
    assert [a.token for a in scored.top] == [1, 2, 0]  # ties: the lower id first
    assert [a.logprob for a in scored.top] == pytest.approx(expected[[1, 2, 0]].tolist())
    assert logprobs(logits, 0, 0, bytes).top == ()
    with pytest.raises(SamplingError, match="top logprobs"):
        logprobs(logits, 0, 21, bytes)


def test_each_piece_carries_its_tokens_logprobs(open_host):
    host = open_host()
    session = host.session()
    session.append_text(PROMPT)
    generation = session.generate(max_tokens=6, keep_logits=True, ignore_eos=True, logprobs=4, temperature=0.8,
                                  seed=3)
    pieces = [piece for piece in generation if piece.token >= 0]
    assert len(pieces) == len(generation.logits) == 6
    for piece, logits in zip(pieces, generation.logits):
        expected = log_softmax(logits)
        assert piece.logprobs.token == piece.token
        assert piece.logprobs.logprob == pytest.approx(expected[piece.token], abs=1e-6)
        assert [a.token for a in piece.logprobs.top] == np.argsort(-expected, kind="stable")[:4].tolist()
        assert piece.logprobs.bytes.decode(errors="replace") == session.detokenize([piece.token])
    without = session.generate(max_tokens=2, ignore_eos=True)
    assert all(piece.logprobs is None for piece in without)
    with pytest.raises(ValueError, match="logprobs"):
        session.generate(max_tokens=2, logprobs=21)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    server = Served(tiny_models["f32"].gguf, tmp_path_factory.mktemp("served-logprobs"))
    yield server
    assert server.stop() == 0


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_served_logprobs_match_the_hosts_logits(served, open_host):
    """The same prompt through the server and through a Host on the same file: the logprobs the
    client gets are the log-softmax of the logits the engine gave, and greedy picks the top one."""
    prompt = "The capital of France is"
    reply = served.client().completions.create(model=served.model, prompt=prompt, max_tokens=5, logprobs=3,
                                               extra_body={"ignore_eos": True})
    got = reply.choices[0].logprobs
    session = open_host(llamacpp_flash_attn=False).session()
    session.append_text(prompt)
    generation = session.generate(max_tokens=5, keep_logits=True, ignore_eos=True)
    generation.collect()
    expected = [log_softmax(row) for row in generation.logits]
    assert got.tokens == [session.detokenize([t]) for t in generation.tokens]
    assert got.token_logprobs == pytest.approx([row[t] for row, t in zip(expected, generation.tokens)], abs=1e-4)
    for alternatives, row, token in zip(got.top_logprobs, expected, generation.tokens):
        # a map by spelling: tokens that spell alike (parts of one character) share a key
        assert 1 <= len(alternatives) <= 3 and max(alternatives.values()) == pytest.approx(row[token], abs=1e-4)
    assert got.text_offset[0] == 0 and "".join(got.tokens) == reply.choices[0].text


def test_served_chat_logprobs_stream_as_they_do_whole(served):
    client = served.client()
    kwargs = dict(model=served.model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
                  logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)
    entries = whole.choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in entries)  # greedy: the top one
    streamed = [entry for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    # the second request starts from the first one's cached prompt: the same logits but for the last bits
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_offsets_count_a_character_split_across_tokens_once():
    from superfluid.http import logprobs as shapes
    from superfluid.host.sampling import TokenLogprobs

    split = [TokenLogprobs(1, "😀".encode()[:2], -1.0, ()), TokenLogprobs(2, "😀".encode()[2:], -1.0, ()),
             TokenLogprobs(3, b"!", -1.0, ())]
    assert shapes.completion(split)["text_offset"] == [0, 0, 1]
    assert shapes.completion(split, offset=5)["text_offset"] == [5, 5, 6]
