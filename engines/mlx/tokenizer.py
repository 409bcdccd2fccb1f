"""The model's Hugging Face tokenizer, safe from any thread: tokenizing never touches MLX, so a
request's text can be tokenized beside the scheduler thread's steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HfTokenizer:
    """Text to token ids and back through a `transformers` tokenizer (thread-safe)."""

    def __init__(self, tokenizer: Any) -> None:
        # No lock: encoding and decoding read the tokenizer and never change it (transformers' fast
        # tokenizers are Rust objects used by many threads at once), and a lock would make the
        # scheduler thread's next piece wait behind another thread's long prompt.
        self._tokenizer = tokenizer

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS added); special tokens written in it are parsed when `special`."""
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`, special tokens rendered."""
        return self._tokenizer.decode(list(tokens), skip_special_tokens=False).encode()
