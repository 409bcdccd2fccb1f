"""The model's Hugging Face tokenizer, safe from any thread: tokenizing never touches MLX, so a
request's text can be tokenized beside the scheduler thread's steps.

Token ids become bytes one token at a time, exactly, as llama.cpp's pieces do: a character split
across several tokens (a byte-level BPE spells "日" in three) comes out as its bytes, which a
reader joins, and never as the replacement characters that decoding each token to text alone
gives (`tokenizers` decodes to str: a lone byte of a character is not one).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from engines.base import TokenVocabulary

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each of the 256 bytes as the printable character a
    token's text spells it with, mapped back to the byte. Printable bytes stand for themselves;
    the others take the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + shifted)] = b
            shifted += 1
    return alphabet


class HfTokenizer:
    """Text to token ids and back through a `transformers` tokenizer (thread-safe)."""

    def __init__(self, tokenizer: Any) -> None:
        # No lock: encoding and decoding read the tokenizer and never change it (transformers' fast
        # tokenizers are Rust objects used by many threads at once), and a lock would make the
        # scheduler thread's next piece wait behind another thread's long prompt.
        self._tokenizer = tokenizer
        self._pieces: dict[int, bytes] = {}  # token -> its bytes (a dict read and set is atomic)
        # the decoder's own description (1.5 ms), not the whole tokenizer's (Gemma 3's: 12 MB, 0.33 s)
        decoder = tokenizer.backend_tokenizer.decoder
        described = decoder.__getstate__().decode() if decoder is not None else ""
        self._byte_level = byte_level_alphabet() if '"ByteLevel"' in described else None
        self._specials = {int(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS added); special tokens written in it are parsed when `special`."""
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes of `tokens`, special tokens rendered: each token's own, joined."""
        return b"".join(self.piece(int(t)) for t in tokens)

    def piece(self, token: int) -> bytes:
        """The bytes of one token: an added token's text; a byte-level BPE token's characters
        mapped back to bytes; a SentencePiece token's text with its word marks as spaces, or its
        byte (a byte-fallback token)."""
        piece = self._pieces.get(token)
        if piece is None:
            text = self._specials.get(token)
            if text is not None:
                piece = text.encode()
            else:
                text = self._tokenizer.convert_ids_to_tokens(token)
                byte = _BYTE_TOKEN.fullmatch(text) if text is not None else None
                if text is None:  # a row of the logits past the tokenizer's tokens (padding): no text
                    piece = b""
                elif byte is not None:
                    piece = bytes([int(byte.group(1), 16)])
                elif self._byte_level is not None and all(c in self._byte_level for c in text):
                    piece = bytes(self._byte_level[c] for c in text)
                else:
                    piece = text.replace("\u2581", " ").encode()
            self._pieces[token] = piece
        return piece

    def vocabulary(self) -> TokenVocabulary:
        """The tokenizer as the `tokenizers` library serializes it (its added tokens included),
        without padding or truncation, which a grammar engine must not apply."""
        backend = copy.copy(self._tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return TokenVocabulary(tokenizer_json=backend.to_str())
