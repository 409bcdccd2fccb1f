"""Token log-probabilities in the shapes OpenAI's API gives them.

Chat completions list one entry per token: `{"token", "logprob", "bytes", "top_logprobs": [...]}`
(the bytes matter when a character spans tokens). Legacy completions give parallel lists: `tokens`,
`token_logprobs`, `top_logprobs` (one `{token: logprob}` map per token) and `text_offset`. Every
sampled token is listed, an end-of-turn token included: it is what the model chose.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from superfluid.host.sampling import TokenLogprobs


def _spelled(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def chat_entries(scored: Sequence[TokenLogprobs]) -> list[dict]:
    """`scored` as the entries of a chat choice's `logprobs.content`."""
    return [{"token": _spelled(s.bytes), "logprob": s.logprob, "bytes": list(s.bytes),
             "top_logprobs": [{"token": _spelled(a.bytes), "logprob": a.logprob, "bytes": list(a.bytes)}
                              for a in s.top]}
            for s in scored]


def chat(scored: Sequence[TokenLogprobs]) -> dict:
    """A chat choice's `logprobs` object."""
    return {"content": chat_entries(scored)}


def completion(scored: Sequence[TokenLogprobs], offset: int = 0) -> dict:
    """A completion choice's `logprobs` object, its text offsets counted from `offset` characters:
    where a token starts in the text, with a character split across tokens counted once."""
    tokens = [_spelled(s.bytes) for s in scored]
    decoder, offsets = codecs.getincrementaldecoder("utf-8")(errors="replace"), []
    for entry in scored:
        offsets.append(offset)
        offset += len(decoder.decode(entry.bytes))
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in scored],
            "top_logprobs": [_by_spelling(s.top) for s in scored], "text_offset": offsets}


def _by_spelling(alternatives) -> dict[str, float]:
    """Alternatives as OpenAI's legacy {token: logprob} map: where several tokens spell alike
    (parts of one character), the key keeps the most likely one's logprob."""
    mapped: dict[str, float] = {}
    for alternative in alternatives:  # most likely first
        mapped.setdefault(_spelled(alternative.bytes), alternative.logprob)
    return mapped
