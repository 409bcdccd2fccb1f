"""Plain-text prompts of an exact token count, for benchmarks that send text.

Every word below is one SmolLM2 token after a space, and "the" is one at the start, so
`text_of(n, salt)` is exactly n tokens for every salt (tests/benchmarks/test_texts.py checks it on
the model). Its 61 words (a prime count) are walked with a step of 7, so every salt visits them
all: texts of the same length differ in their words but not in their cost.
"""

WORDS = ("the pool keeps what engines park there within a hard budget and lets state move between sessions "
         "without copies so a fork shared prefix or resumed session costs count one copy memory cache model "
         "token time fast slow long short new old first last next page file data work user text line word each "
         "every some many few more less small").split()


def text_of(tokens: int, salt: int = 0) -> str:
    """`tokens` tokens of plain text (for SmolLM2's tokenizer), varied by `salt`."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    return " ".join(["the"] + [WORDS[(i * 7 + salt) % len(WORDS)] for i in range(1, tokens)])
