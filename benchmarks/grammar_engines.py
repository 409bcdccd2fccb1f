"""The grammar engines a constrained sampler could use, on our models' vocabularies, side by side:
llguidance (the one superfluid depends on) and xgrammar (vLLM's and SGLang's; its wheel requires
torch and triton, so it is measured only where it is installed: a throwaway environment).

For each vocabulary (SmolLM2's 49,152 tokens, Gemma 3's 262,144) and each schema of
`SCHEMAS` (one valid instance each, tokenized by the model's own llama.cpp tokenizer):

- the time to build the engine's tokenizer view (once per model),
- the time to compile a schema (a cache keeps it after the first request),
- the time to compute each token's mask along the instance (what a constrained step adds beside
  the engine's step: median and worst), and whether every token of the instance was allowed
  (both engines keep a schema's property order: an instance in another order is refused).

    .venv/bin/python benchmarks/grammar_engines.py
    # xgrammar, in an environment of its own (5.7 GB with torch), with this project's llama_cpp:
    python3.11 -m venv /tmp/xg && /tmp/xg/bin/pip install xgrammar
    PYTHONPATH=.venv/lib/python3.11/site-packages /tmp/xg/bin/python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp  # noqa: E402

from engines import models  # noqa: E402

SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36}),
    ({"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                       "temp": {"type": "number", "minimum": -50, "maximum": 60}},
      "required": ["city", "temp"]},
     {"city": "Paris", "temp": 21.5}),
    ({"type": "array", "minItems": 1, "maxItems": 5,
      "items": {"type": "object", "required": ["id", "tags", "ok"], "properties": {
          "id": {"type": "integer", "minimum": 0},
          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}, "ok": {"type": "boolean"}}}},
     [{"id": 1, "tags": ["a", "bb"], "ok": True}, {"id": 2, "tags": [], "ok": False}]),
    ({"type": "object", "required": ["email", "phone", "address", "kind"], "properties": {
        "email": {"type": "string", "format": "email"},
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "address": {"type": "object", "required": ["street", "zip"], "properties": {
            "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "kind": {"anyOf": [{"type": "string", "enum": ["home", "work"]}, {"type": "null"}]}}},
     {"email": "ada@example.com", "phone": "555-1234", "address": {"street": "1 Main St", "zip": "12345"},
      "kind": "work"}),
    ({"type": "object", "required": ["title", "steps", "serves"], "properties": {
        "title": {"type": "string", "maxLength": 80},
        "steps": {"type": "array", "items": {"type": "object", "required": ["n", "text"], "properties": {
            "n": {"type": "integer"}, "text": {"type": "string"}, "minutes": {"type": "number"}}}},
        "serves": {"type": "integer", "minimum": 1, "maximum": 12}, "vegan": {"type": "boolean"}}},
     {"title": "Pancakes", "steps": [{"n": 1, "text": "Mix flour and milk", "minutes": 5},
                                     {"n": 2, "text": "Fry in a hot pan", "minutes": 10}], "serves": 4, "vegan": False}),
]


class Vocabulary:
    """A model's llama.cpp vocabulary: each token's bytes, its end tokens, and its tokenizer."""

    def __init__(self, path: Path) -> None:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.size = llama_cpp.llama_vocab_n_tokens(self.vocab)
        buffer = ctypes.create_string_buffer(1 << 14)
        self.pieces = []
        for token in range(self.size):
            length = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, 1 << 14, 0, True)
            self.pieces.append(bytes(buffer[:length]))
        self.eos = sorted({t for t in (llama_cpp.llama_vocab_eos(self.vocab), llama_cpp.llama_vocab_eot(self.vocab))
                           if t >= 0})

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        count = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, len(data) + 8, False, False)
        return list(out[:count])


def measure(engine: str, vocabulary: Vocabulary) -> None:
    """One engine on one vocabulary: a line per schema."""
    began = time.perf_counter()
    if engine == "llguidance":
        import llguidance
        import llguidance.llamacpp
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(vocabulary.vocab, eos_token=vocabulary.eos)
        mask = allocate_token_bitmask(1, vocabulary.size)

        def compile_schema(schema):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            matcher = llguidance.LLMatcher(tokenizer, grammar)
            assert not matcher.is_error(), matcher.get_error()
            return matcher

        def fill(matcher):
            fill_next_token_bitmask(matcher, mask, 0)

        def accept(matcher, token):
            return matcher.consume_token(token)
    else:
        import xgrammar
        info = xgrammar.TokenizerInfo(vocabulary.pieces, vocab_type=xgrammar.VocabType.RAW,
                                      stop_token_ids=vocabulary.eos)
        compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

        def compile_schema(schema):
            return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                        separators=(",", ":")))

        def fill(matcher):
            matcher.fill_next_token_bitmask(mask)

        def accept(matcher, token):
            return matcher.accept_token(token)
    print(f"  {engine}: tokenizer view in {time.perf_counter() - began:.2f} s")
    for number, (schema, instance) in enumerate(SCHEMAS):
        began = time.perf_counter()
        matcher = compile_schema(schema)
        compiled = time.perf_counter() - began
        tokens = vocabulary.tokenize(json.dumps(instance, separators=(",", ":")))
        masks, allowed = [], True
        for token in tokens:
            began = time.perf_counter()
            fill(matcher)
            masks.append(time.perf_counter() - began)
            allowed = allowed and bool(np.asarray(mask).reshape(-1)[token // 32] >> (token % 32) & 1)
            if not accept(matcher, token):
                allowed = False
                break
        print(f"    schema {number}: compile {compiled * 1000:6.1f} ms; mask per token median "
              f"{statistics.median(masks) * 1e6:5.0f} us, worst {max(masks) * 1e6:6.0f} us, over {len(masks)} tokens; "
              f"every token of the instance allowed: {allowed}")


def main() -> int:
    engines = []
    for name in ("llguidance", "xgrammar"):
        try:
            __import__(name)
            engines.append(name)
        except ImportError:
            print(f"({name} is not installed here: not measured)")
    for label, path in (("SmolLM2-135M", models.default_model()), ("Gemma 3 270M", models.gemma3_model())):
        vocabulary = Vocabulary(path)
        print(f"{label}: {vocabulary.size:,} tokens")
        for engine in engines:
            measure(engine, vocabulary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
