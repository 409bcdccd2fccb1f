"""llama.cpp's tokenizer, safe from any thread: it reads the model's vocabulary, never the
context, so a request's text can be tokenized beside the scheduler thread's decode steps.

Only calls that run ggml's compute bring OpenMP thread teams, which is why the engine itself is
called from one thread. Tokenizing is not one of them: on SmolLM2 with 2 threads on 2 cores,
decode ran at 0.96-0.97 of its speed alone while a second thread that had tokenized stayed alive
(a thread that has decoded makes every step about 3x slower). What a thread tokenizing without
pause does cost is the CPU it takes (0.27 of the speed on 2 cores), as any other work would.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from engines.base import TokenVocabulary
from engines.errors import EngineError


class LlamaTokenizer:
    """Text to token ids and back through a loaded model's vocabulary (thread-safe)."""

    def __init__(self, api: Any, vocab: Any, n_vocab: int) -> None:
        """`vocab`: llama_model_get_vocab of a model that stays loaded until `close`."""
        self._api, self._vocab, self._n_vocab = api, vocab, n_vocab
        self._pieces: dict[int, bytes] = {}  # token -> its bytes (a dict read and set is atomic)
        # Calls run side by side (llama.cpp's tokenizer only reads the vocabulary, as llama-server's
        # HTTP threads use it): one thread's 700 KB prompt must not hold up the scheduler thread's
        # next piece. They are counted, so close() frees the model only once none is running.
        self._calls = threading.Condition()
        self._running = 0

    def tokenize(self, text: str, *, special: bool = True, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it are parsed when `special`."""
        data = text.encode()
        capacity = len(data) + 8
        with self._call() as vocab:
            while True:
                buffer = (self._api.llama_token * capacity)()
                n = self._api.llama_tokenize(vocab, data, len(data), buffer, capacity, add_bos, special)
                if n >= 0:
                    return list(buffer[:n])
                capacity = -n

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`, special tokens rendered."""
        return b"".join(self.piece(int(t)) for t in tokens)

    def piece(self, token: int) -> bytes:
        """The bytes of one token."""
        piece = self._pieces.get(token)
        if piece is None:
            if not 0 <= token < self._n_vocab:
                raise EngineError(f"token {token} is outside the vocabulary of {self._n_vocab}")
            with self._call() as vocab:
                buffer = ctypes.create_string_buffer(64)
                n = self._api.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
                if n < 0:
                    buffer = ctypes.create_string_buffer(-n)
                    n = self._api.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
            piece = self._pieces[token] = buffer.raw[:n]
        return piece

    def vocabulary(self) -> TokenVocabulary:
        """Every token's bytes; a control token's (and a user-defined one written like one, as
        `<|...|>`) marked with a leading 0xff, so that a grammar's text never spells it."""
        api, pieces = self._api, []
        kind_of = getattr(api, "llama_vocab_get_attr", None) or api.llama_token_get_attr  # (older releases' name)
        with self._call() as vocab:
            buffer = ctypes.create_string_buffer(1 << 14)
            for token in range(self._n_vocab):
                n = api.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
                piece = buffer.raw[:max(n, 0)]
                kind = kind_of(vocab, token)
                if kind & api.LLAMA_TOKEN_ATTR_CONTROL or (kind & api.LLAMA_TOKEN_ATTR_USER_DEFINED
                                                          and piece.startswith(b"<") and piece.endswith(b">")):
                    piece = b"\xff" + piece
                pieces.append(piece)
        return TokenVocabulary(pieces=tuple(pieces))

    def close(self, free_model) -> None:
        """Call `free_model` once no tokenization is running; any later one raises EngineError."""
        with self._calls:
            self._vocab = None  # no call starts after this
            self._calls.wait_for(lambda: self._running == 0)
            free_model()

    @contextlib.contextmanager
    def _call(self) -> Iterator[Any]:
        """The vocabulary, for one call; EngineError once the model is closed."""
        with self._calls:
            vocab = self._vocab
            if vocab is None:
                raise EngineError("the model was closed: its tokenizer is gone with it")
            self._running += 1
        try:
            yield vocab
        finally:
            with self._calls:
                self._running -= 1
                self._calls.notify_all()
