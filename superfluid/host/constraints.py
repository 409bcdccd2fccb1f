"""Constrained generation: a generation's output kept within a JSON schema, a regular expression,
a list of choices or a grammar, by a mask over the logits before each token is sampled.

The mask comes from llguidance (chosen over xgrammar: benchmarks/grammar_engines.py): a grammar
is compiled once against the model's vocabulary and each generation walks its own copy of the
compiled matcher, token by token. So:

- **Compiling is the caller's** (`Grammars.compile`, on the thread that asks: the server's worker
  threads, an application's own), never the scheduler thread's; compiled grammars are kept (a
  small LRU, hits and misses counted), so a schema seen before costs a copy of its matcher.
- **A generation's place in its grammar is a function of the tokens it committed** since it
  began: a preempted, parked or resumed generation goes on from where it was, since its matcher
  goes with its job, and a fork starts no generation of its own.
- **Only tokens the grammar allows are drawn.** The sampler sees every other token's logit at
  minus infinity, after the model's raw logits are kept for logprobs (which report what the model
  thought, as without a constraint). End-of-generation tokens are allowed only where the grammar
  may end; once it cannot go on, the generation stops.
- **JSON whitespace is bounded**: outside strings, a JSON constraint allows no whitespace at all
  (compact JSON: `{"a":1,"b":[2,3]}`), so a small model cannot fill `max_tokens` with spaces; a
  schema's own `x-guidance` options cannot turn that off.
- **Objects are closed unless the schema opens them**: an object schema that lists `properties`
  and says nothing of others gets none beyond those (as vLLM's and SGLang's engines do by
  default, and OpenAI's strict mode requires). Its output still validates against the schema as
  given; without this, a small model went on adding keys until `max_tokens` cut it (SmolLM2: 4 of
  32 schemas of benchmarks/structured.py).

Errors: a schema or grammar that does not compile, is past MAX_SOURCE, or took longer than
`compile_seconds` to compile, is a ConstraintError before anything is queued; a generation whose
grammar allows no next token ends with one.

Compiling costs what the grammar asks: llguidance bounds it with fuel (LIMITS: the lexer's
regular expressions, the grammar's size, its lexer states), and a grammar that compiled within
those but took more than `compile_seconds` of CPU time is refused all the same, and remembered as refused,
so that a client resending it costs nothing the second time.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import llguidance
import msgspec
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from engines.base import TokenVocabulary
from superfluid.host.errors import SuperfluidError

MAX_SOURCE = 256 * 1024  # bytes of a schema or grammar as given (a real one is a few KiB)
COMPILE_SECONDS = 2.0  # a constraint that takes longer to compile is refused (the schemas of
# benchmarks/structured.py compile in 0.6-1.0 ms on the models here)
# llguidance's own bounds on the work of compiling and of each mask, at its defaults (the lexer's
# initial fuel, 1,000,000 at about 50,000 a millisecond; 500,000 grammar symbols; 250,000 lexer
# states): given here so that they are ours to change. Heavy schemas within them (40 patterned
# properties, a 3,000-value enum, 30 nested objects, a 300-branch pattern) compiled in 6-15 ms
# against SmolLM2's vocabulary.
LIMITS = llguidance.LLParserLimits()
KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
# JSON as the constraint writes it: compact, no free whitespace (llguidance's options, applied over
# whatever a schema's own "x-guidance" says)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class ConstraintError(SuperfluidError, ValueError):
    """A constraint that cannot be compiled or is past a limit (the message names which), or a
    generation whose constraint left no token possible."""


class Constraint(msgspec.Struct, frozen=True):
    """What a generation's output must match: `kind` (one of KINDS) and its `source` (a schema as
    JSON text, a regular expression, the choices as a JSON list, a Lark or GBNF grammar)."""

    kind: str
    source: str
    lenient: bool = False  # a JSON schema's keywords the engine does not implement are ignored, not refused

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise ConstraintError(f"a {self.kind} constraint's source must be text")
        if len(self.source.encode()) > MAX_SOURCE:
            raise ConstraintError(f"the {self.kind} is {len(self.source.encode()):,} bytes; at most {MAX_SOURCE:,} are "
                                  "compiled: give a smaller one")

    @classmethod
    def json_schema(cls, schema: dict | bool | str, *, strict: bool = True) -> Constraint:
        """Output that is one JSON value valid under `schema` (a dict, or its JSON text). `strict`:
        a keyword the grammar engine does not implement (`uniqueItems`, say) is a ConstraintError
        naming it; else it is ignored, and the output follows every other keyword."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if schema is True:
            schema = {}  # any value
        if schema is False:
            raise ConstraintError("the JSON schema `false` accepts no value: no output could follow it")
        if not isinstance(schema, dict):
            raise ConstraintError("a JSON schema is an object (or true)")
        # (its key order is the output's)
        return cls("json_schema", json.dumps(closed(schema), separators=(",", ":")), lenient=not strict)

    @classmethod
    def json_object(cls) -> Constraint:
        """Output that is one JSON object, of any content."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output that matches `pattern` whole."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Output that is exactly one of `options`."""
        if isinstance(options, str) or not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError("choices must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Output in the language of a Lark grammar (llguidance's dialect; `start` is its rule)."""
        return cls("lark", grammar)

    @classmethod
    def gbnf(cls, grammar: str) -> Constraint:
        """Output in the language of a GBNF grammar, as llama.cpp writes them (`root` is its rule)."""
        return cls("gbnf", grammar)

    def grammar(self) -> str:
        """The constraint as llguidance's grammar text (ConstraintError where it cannot be one)."""
        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(json.loads(self.source),
                                                                     overrides={**JSON_OPTIONS, "lenient": self.lenient})
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "choice":
                alternatives = " | ".join(json.dumps(option) for option in json.loads(self.source))
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            if self.kind == "lark":
                return llguidance.LLMatcher.grammar_from_lark(self.source)
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(self.source))
        except Exception as exc:  # noqa: BLE001 - the converters raise bare Exceptions for a bad grammar
            raise ConstraintError(f"the {self.kind} cannot be read: {exc}") from None


# Keywords whose subschemas describe *other* values (a property's, an item's): each is closed on
# its own. Subschemas that describe the same object as their parent (allOf, not, if/then/else,
# dependentSchemas) are left as they are: closing one of them could make the whole accept nothing,
# or accept what it refused (a closed branch of `not`).
_VALUE_SCHEMA = ("additionalProperties", "items", "contains", "additionalItems", "unevaluatedItems")
_VALUE_SCHEMAS = ("prefixItems",)
_VALUE_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SHARED = ("allOf", "$ref", "if", "dependentSchemas", "not")  # beside these, an object's keys are not all listed here


def closed(schema: Any) -> Any:
    """`schema` with each object schema that lists `properties`, says nothing of others, and is
    the whole description of its object, closed to them (`additionalProperties: false`): a schema
    every output of which validates against `schema`. anyOf / oneOf branches are closed only
    where their parent lists no properties of its own (each branch then describes the object
    alone)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _VALUE_SCHEMA:
        if key in out:
            out[key] = [closed(s) for s in out[key]] if isinstance(out[key], list) else closed(out[key])
    for key in _VALUE_SCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _VALUE_SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if "properties" not in out:
        for key in ("anyOf", "oneOf"):
            if isinstance(out.get(key), list):
                out[key] = [closed(s) for s in out[key]]
    if ("properties" in out and not any(key in out for key in _OPENERS + _SHARED)
            and not any(key in out for key in ("anyOf", "oneOf"))):
        out["additionalProperties"] = False
    return out


class Compiled:
    """A constraint compiled against one model's vocabulary: each generation walks a copy."""

    def __init__(self, constraint: Constraint, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.constraint, self._pristine, self.vocab_size = constraint, matcher, vocab_size

    def start(self) -> Matching:
        """A generation's own walk through the grammar, at its start."""
        return Matching(self._pristine.deep_copy(), self.vocab_size)


class Matching:
    """One generation's place in its grammar: which tokens may come next, and the tokens taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher, self.vocab_size = matcher, vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # llguidance's bitmask layout

    def allowed(self) -> np.ndarray:
        """Which tokens may come next, as a bool per token id (none: the grammar is stuck)."""
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        return np.unpackbits(words.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def advance(self, token: int) -> None:
        """Take `token` (one `allowed` said may come); ConstraintError if the grammar refuses it."""
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise ConstraintError(f"the constraint refused token {token}: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """True once the grammar can take no other token than an end of generation."""
        return self._matcher.is_stopped()

    @property
    def stuck(self) -> bool:
        """True when the grammar can go on no further without being satisfied: an error, or
        stopped where it does not accept (llguidance then allows an end of generation alone,
        which must not pass for a finished output)."""
        matcher = self._matcher
        return matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting())

    @property
    def error(self) -> str:
        """What stopped the grammar, if an error did ("" otherwise)."""
        return self._matcher.get_error()


class Masks:
    """Masks computed beside the engine's step: started on a thread of their own before it (what a
    generation may take next depends only on the tokens it has taken), read when its logits come.
    llguidance lets go of the GIL while it computes, so the step and the masks run side by side."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[Any, concurrent.futures.Future] = {}

    def start(self, walks: Iterable[tuple[Any, Matching]]) -> None:
        """Begin each (key, matching)'s next mask (forgetting any not taken: a step whose lanes
        did not emit. One thread runs them in turn, so a mask still running from such a step
        finishes before the next one of the same matching starts)."""
        self._pending.clear()
        for key, matching in walks:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="superfluid-mask")
            self._pending[key] = self._pool.submit(matching.allowed)

    def take(self, key: Any, matching: Matching) -> np.ndarray:
        """The mask begun for `key`, once it is done (computed now if none was begun)."""
        future = self._pending.pop(key, None)
        return matching.allowed() if future is None else future.result()

    def discard(self) -> None:
        """Forget the masks of a step that did not run (a matching is not changed by a mask)."""
        self._pending.clear()

    def close(self) -> None:
        """End the thread (the host is closing)."""
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def constrained(logits: np.ndarray, matching: Matching, allowed: np.ndarray | None = None) -> np.ndarray:
    """`logits` with every token `matching` does not allow next at minus infinity (a new array:
    the model's own logits stay as they were, for logprobs); `allowed`: that mask, computed
    already. ConstraintError when none is allowed."""
    allowed = matching.allowed() if allowed is None else allowed
    if matching.stuck or not allowed.any():
        raise ConstraintError("the constraint allows no next token here"
                              + (f" ({matching.error})" if matching.error else "") + ": the output so far is kept")
    if len(allowed) < len(logits):  # rows padded past the vocabulary: never allowed
        allowed = np.concatenate([allowed, np.zeros(len(logits) - len(allowed), dtype=bool)])
    return np.where(allowed[:len(logits)], logits, -np.inf)


class Grammars:
    """One model's compiled constraints (safe from any thread): the grammar engine's view of its
    vocabulary, made on first use, and the last `capacity` constraints compiled against it."""

    def __init__(self, vocabulary: Callable[[], TokenVocabulary], tokenize: Callable[[str], list[int]],
                 end_tokens: Sequence[int], vocab_size: int, capacity: int = 64,
                 compile_seconds: float = COMPILE_SECONDS, clock: Callable[[], float] = time.thread_time) -> None:
        """`vocabulary`: the tokenizer's (asked once, when the first constraint is compiled);
        `tokenize`: text to ids without special tokens; `end_tokens`: what ends a generation;
        `vocab_size`: the length of the logits rows; `compile_seconds`: the longest a constraint
        may take to compile, in CPU time of the thread compiling it (`clock`: llguidance compiles
        on the calling thread, without the GIL; wall time would count what else a busy machine
        runs, and a refusal is remembered)."""
        self._vocabulary, self._tokenize = vocabulary, tokenize
        self.end_tokens, self.vocab_size, self.capacity = tuple(end_tokens), vocab_size, capacity
        self.compile_seconds, self._clock = compile_seconds, clock
        self._tokenizer: llguidance.LLTokenizer | ConstraintError | None = None  # (an error: it cannot be made)
        self._compiled: OrderedDict[Constraint, Compiled] = OrderedDict()
        self._too_slow: OrderedDict[Constraint, ConstraintError] = OrderedDict()  # refused for their compile time
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, constraint: Constraint) -> Compiled:
        """`constraint` compiled (from the cache when it was before); ConstraintError naming what
        is wrong with it."""
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                self.hits += 1
                return found
            refused = self._too_slow.get(constraint)
            if refused is not None:
                raise refused
            self.misses += 1
            tokenizer = self._tokenizer_view()
        began = self._clock()
        grammar = constraint.grammar()  # outside the lock: a long grammar does not hold up the others
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise ConstraintError(f"the {constraint.kind} does not compile: {matcher.get_error()}")
        took = self._clock() - began
        if took > self.compile_seconds:
            refused = ConstraintError(f"the {constraint.kind} took {took:.1f} s to compile, past the limit of "
                                      f"{self.compile_seconds:g} s: give a simpler one")
            with self._lock:
                self._too_slow[constraint] = refused
                while len(self._too_slow) > self.capacity:
                    self._too_slow.popitem(last=False)
            raise refused
        compiled = Compiled(constraint, matcher, self.vocab_size)
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    def _tokenizer_view(self) -> llguidance.LLTokenizer:
        # (under the lock: made once; it reads the whole vocabulary, 0.3-2.5 s on the models here;
        # a vocabulary the grammar engine cannot read is said once and remembered)
        if isinstance(self._tokenizer, ConstraintError):
            raise self._tokenizer
        if self._tokenizer is None:
            try:
                self._tokenizer = self._make_tokenizer_view()
            except (ValueError, TypeError) as exc:  # what llguidance raises for a vocabulary it cannot read
                self._tokenizer = ConstraintError(f"this model's vocabulary cannot be read by the grammar engine ({exc}): "
                                                  "it cannot constrain a generation")
                raise self._tokenizer from None
        return self._tokenizer

    def _make_tokenizer_view(self) -> llguidance.LLTokenizer:
        """The grammar engine's view of the vocabulary (ValueError where it cannot read it)."""
        vocabulary, ends = self._vocabulary(), list(self.end_tokens)
        if vocabulary.tokenizer_json is not None:
            return llguidance.LLTokenizer(vocabulary.tokenizer_json, n_vocab=self.vocab_size, eos_token=ends)
        pieces = _Pieces(vocabulary.pieces, ends, self._tokenize)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(pieces), n_vocab=self.vocab_size, eos_token=ends)


class _Pieces:
    """A vocabulary given as each token's bytes, in the shape llguidance's TokenizerWrapper reads."""

    def __init__(self, pieces: Sequence[bytes], ends: list[int], tokenize: Callable[[str], list[int]]) -> None:
        self.tokens = list(pieces)
        self.eos_token_id = ends[0] if ends else None
        self.bos_token_id = None
        self.special_token_ids = [i for i, piece in enumerate(self.tokens) if piece.startswith(b"\xff")]
        self._tokenize = tokenize

    def __call__(self, text: Any) -> list[int]:
        return self._tokenize(text.decode(errors="replace") if isinstance(text, bytes) else text)
