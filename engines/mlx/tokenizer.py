"""The model's Hugging Face tokenizer, safe from any thread: tokenizing never touches MLX, so a
request's text can be tokenized beside the scheduler thread's steps."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class HfTokenizer:
    """Text to token ids and back through a `transformers` tokenizer (thread-safe)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        # a fast tokenizer's Rust core may be shared across threads, a slow one's Python state may not
        self._lock = threading.Lock()

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS added); special tokens written in it are parsed when `special`."""
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`, special tokens rendered."""
        with self._lock:
            return self._tokenizer.decode(list(tokens), skip_special_tokens=False).encode()
