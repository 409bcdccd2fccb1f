"""A GGUF vocabulary as a Hugging Face fast tokenizer that splits text as llama.cpp does.

Two kinds of GGUF vocabulary are rebuilt (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE from the vocabulary and merges, with the pre-tokenizer named by
  `tokenizer.ggml.pre` where this module implements it (the GPT-2 split, or SmolLM's digits one
  by one before it); any other pre-tokenizer is refused by name, never given the GPT-2 split.
- "llama": SentencePiece pieces with scores (Gemma, Llama 2, Mistral). llama.cpp merges the
  adjacent pair of symbols whose concatenation is a token of the highest score, leftmost first,
  starting from UTF-8 characters, with spaces written as ▁ and characters that end no token
  spelled as <0xXX> byte tokens. That is BPE whose merges are every split of every token into
  two tokens, ranked by the score of the token they make: the same tokens wherever no two
  tokens share a score (ties are counted in `SentencePieceMerges.ties`).

Control and unknown tokens are special (matched in text only when special tokens are parsed);
user-defined ones are matched in text always, as llama.cpp does. The end-of-generation set is
llama.cpp's (`llama_vocab_is_eog`): eos, eot, eom, the FIM pad/repo/separator tokens (named in
the metadata or found by their text, as llama.cpp does) and every token whose text is one of the
end markers llama.cpp knows by text (Gemma's <end_of_turn>).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.errors import ModelLoadError

# llama.cpp's token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # ▁, SentencePiece's space

# tokenizer.ggml.pre values whose split this module implements (llama.cpp's names): the plain
# GPT-2 regex, and the same after splitting digits one by one
GPT2_SPLIT = ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
              "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling")
DIGITS_THEN_GPT2 = ("smollm", "codeshell", "exaone", "minerva", "mellum2")
SUPPORTED_MODELS = ("gpt2", "llama")

# Token texts llama.cpp treats as end of generation whatever the metadata says (llama-vocab.cpp,
# "maintain a list of tokens that cause end-of-generation")
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# Metadata ids that are end of generation when present
EOG_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
# FIM tokens llama.cpp finds by text where the metadata names none; they end generation too
FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# llama.cpp's defaults where the metadata names no bos or eos
DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {}}


def _plain(value: Any) -> Any:
    """A metadata value as plain Python (MLX and numpy arrays become lists or scalars)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def special_id(meta: dict, name: str, n_tokens: int) -> int | None:
    """tokenizer.ggml.<name>_token_id, or llama.cpp's default for the vocabulary's kind; None
    when absent or out of range."""
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    value = DEFAULT_IDS.get(meta.get("tokenizer.ggml.model"), {}).get(name) if value is None else int(_plain(value))
    return value if value is not None and 0 <= value < n_tokens else None


def end_of_generation(meta: dict, tokens: list[str]) -> tuple[int, ...]:
    """llama.cpp's end-of-generation token ids for this vocabulary: the model's eos first (chat
    templates render the first as eos_token, as the llama.cpp adapter orders them), then by id."""
    eog = {i for i in (special_id(meta, key, len(tokens)) for key in EOG_KEYS) if i is not None}
    for key, texts in FIM_TEXTS.items():
        if special_id(meta, key, len(tokens)) is None:
            found = [i for i, text in enumerate(tokens) if text in texts]
            eog.update(found[:1])  # llama.cpp takes one (whichever its hash map yields first)
    eog.update(i for i, text in enumerate(tokens) if text in EOG_TEXTS)
    texts = {tokens[i]: i for i in eog}
    # llama.cpp: with <|return|> and <|call|> (or <|calls|> and <|flush|>), <|end|> is not EOG;
    # with <|tool_response>, </s> is a normal token
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts.keys() or {"<|calls|>", "<|flush|>"} <= texts.keys()):
        eog.discard(texts["<|end|>"])
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
    eos = special_id(meta, "eos", len(tokens))
    return tuple(sorted(eog, key=lambda t: (t != eos, t)))


def adds_bos(meta: dict) -> bool:
    """Whether llama.cpp puts BOS before a prompt (tokenizer.ggml.add_bos_token; true when absent)."""
    value = meta.get("tokenizer.ggml.add_bos_token")
    return True if value is None else bool(_plain(value))


@dataclass(frozen=True)
class SentencePieceMerges:
    """BPE merges equivalent to llama.cpp's SentencePiece merging, and how many pairs of
    mergeable tokens share a score (where the two algorithms may order merges differently)."""

    merges: list[tuple[str, str]]
    ties: int


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> SentencePieceMerges:
    """Every split of every token into two tokens, ranked by the score of the token they make
    (highest first; equal scores by token id)."""
    ids = {text: index for index, text in enumerate(tokens)}  # the last of duplicate texts, as llama.cpp
    made: list[tuple[float, int, str, str]] = []
    for text, index in ids.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in ids and right in ids:
                made.append((-scores[index], index, left, right))
    made.sort()
    mergeable = {index for _, index, _, _ in made}
    seen_scores: dict[float, int] = {}
    for index in mergeable:
        seen_scores[scores[index]] = seen_scores.get(scores[index], 0) + 1
    ties = sum(count - 1 for count in seen_scores.values())
    return SentencePieceMerges([(left, right) for _, _, left, right in made], ties)


def tokenizer_from(meta: dict):
    """A Hugging Face fast tokenizer rebuilt from the GGUF vocabulary, carrying llama.cpp's
    end-of-generation ids (`superfluid_eog`) and BOS rule (`superfluid_add_bos`)."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta)
    elif model == "llama":
        tokenizer = _sentencepiece(meta)
    else:
        raise ModelLoadError(f"GGUF tokenizer model {model!r} is not supported by the MLX adapter yet; supported: "
                             f"{', '.join(SUPPORTED_MODELS)} (use runtime llamacpp)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokenizer.superfluid_eog = end_of_generation(meta, tokens)
    tokenizer.superfluid_add_bos = adds_bos(meta)
    return tokenizer


def specials(tokenizer) -> tuple[int | None, tuple[int, ...]]:
    """(BOS to put before a prompt or None, end-of-generation ids) of a tokenizer: as llama.cpp
    says for one rebuilt from GGUF, else its own bos and eos."""
    eog = getattr(tokenizer, "superfluid_eog", None)
    if eog is None:  # a model directory's tokenizer: a BOS where its own encoding adds one
        bos = tokenizer.bos_token_id
        if bos is not None and tokenizer.encode("a")[:1] != [bos]:
            bos = None
        return bos, ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    return (tokenizer.bos_token_id if tokenizer.superfluid_add_bos else None), tuple(eog)


def _kinds(meta: dict, n: int) -> list[int]:
    return [int(t) for t in _plain(meta.get("tokenizer.ggml.token_type", [NORMAL] * n))]


def _token(meta: dict, tokens: list[str], name: str) -> str | None:
    index = special_id(meta, name, len(tokens))
    return tokens[index] if index is not None else None


def _wrap(core, meta: dict, tokens: list[str], defaults: bool):
    from transformers import PreTrainedTokenizerFast

    def token(name):
        if defaults:
            return _token(meta, tokens, name)
        index = meta.get(f"tokenizer.ggml.{name}_token_id")  # as before: only what the metadata names
        return tokens[int(_plain(index))] if index is not None else None

    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=token("bos"), eos_token=token("eos"),
                                   chat_template=meta.get("tokenizer.chat_template"),
                                   clean_up_tokenization_spaces=False)


def _byte_level_bpe(meta: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre")
    if pre not in GPT2_SPLIT + DIGITS_THEN_GPT2:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported by the MLX adapter yet; supported: "
                             f"{', '.join(GPT2_SPLIT + DIGITS_THEN_GPT2)} (use runtime llamacpp)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    kinds = _kinds(meta, len(tokens))
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # llama.cpp's "smollm" pre-tokenizer (and its kin) splits digits one by one before the byte-level split.
    bpe.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre in DIGITS_THEN_GPT2 else byte_level)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([token for token, kind in zip(tokens, kinds) if kind == CONTROL])
    return _wrap(bpe, meta, tokens, defaults=False)


def _sentencepiece(meta: dict):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = [float(s) for s in _plain(meta.get("tokenizer.ggml.scores", [0.0] * len(tokens)))]
    kinds = _kinds(meta, len(tokens))
    if len(scores) != len(tokens) or len(kinds) != len(tokens):
        raise ModelLoadError(f"GGUF vocabulary of {len(tokens)} tokens has {len(scores)} scores and "
                             f"{len(kinds)} token types")
    merged = sentencepiece_merges(tokens, scores)
    unk = _token(meta, tokens, "unk")
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merged.merges,
                                unk_token=unk, fuse_unk=True, byte_fallback=True))
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix")
    space_prefix = True if space_prefix is None else bool(_plain(space_prefix))  # llama.cpp's default for SPM
    steps = [normalizers.Replace(" ", SPACE)]
    core.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if space_prefix else []) + steps)
    core.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                     + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, kinds)
                             if kind in (CONTROL, UNKNOWN)])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, kinds)
                     if kind == USER_DEFINED])
    tokenizer = _wrap(core, meta, tokens, defaults=True)
    tokenizer.superfluid_merge_ties = merged.ties
    return tokenizer
