"""Tool calls against real models' chat templates (read from llama.cpp's sources at test time):
our rendering with tools is transformers'; each template's call format is recognised; what a
template renders for an assistant's calls is read back as those calls, whole and streamed in any
pieces; the grammar of a required call accepts exactly what the template renders for it; and a
template that takes no tools gets them described, with earlier calls and results written out."""

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from superfluid.host.chat import ChatTemplate
from superfluid.host.constraints import Grammars
from superfluid.host.errors import ChatError
from superfluid.host.messages import for_template
from superfluid.host.tools import Tools, ToolUse, format_of
from tests import realtemplates
from tests.superfluid.test_tools import TOOLS

TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
END_MARKS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>")
CALL = {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "C"}'}}
SECOND = {"id": "jklmnopqr", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
CONVERSATIONS = {
    "one call and its result": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "abcdefghi", "name": "get_weather"}],
    "two calls, their results, and a question": [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, SECOND]},
        {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "abcdefghi", "name": "get_weather"},
        {"role": "tool", "content": "14:05", "tool_call_id": "jklmnopqr", "name": "get_time"},
        {"role": "assistant", "content": "18 C, 14:05."}, {"role": "user", "content": "Thanks"}],
}
FORMATS = {"Llama 3.1": "llama3", "Llama 3.2": "llama3", "Llama 3.3": "llama3", "Qwen 2.5": "hermes",
           "Qwen 3": "hermes", "Hermes 2 Pro": "hermes", "Hermes 3": "hermes", "Mistral Nemo": "mistral",
           "Mistral Small 3.2": "mistral_args"}


def theirs(source: str, messages: list, generation_prompt: bool, tools) -> str:
    rendered, _ = render_jinja_template([[for_template(m) for m in messages]], chat_template=source, tools=tools,
                                        add_generation_prompt=generation_prompt, **TOKENS)
    return rendered[0]


@pytest.mark.parametrize("model", sorted(FORMATS))
def test_tools_and_calls_render_as_transformers_renders_them(model):
    source = realtemplates.from_llama_cpp()[model]
    template = ChatTemplate(source, **TOKENS)
    assert template.takes_tools
    for name, messages in CONVERSATIONS.items():
        for generation_prompt in (False, True):
            try:
                expected = theirs(source, messages, generation_prompt, TOOLS)
            except Exception as exc:  # noqa: BLE001 - the template's refusal (Llama 3: one call a turn)
                with pytest.raises(ChatError) as ours:
                    template.render(messages, generation_prompt, Tools.of(TOOLS))
                assert str(exc) in str(ours.value), (model, name)
                continue
            # a template that writes today's date: rendered again if the day turned in between
            rendered = template.render(messages, generation_prompt, Tools.of(TOOLS))
            assert rendered == expected or template.render(messages, generation_prompt, Tools.of(TOOLS)) == expected, \
                (model, name, generation_prompt)


@pytest.mark.parametrize("model, kind", sorted(FORMATS.items()))
def test_each_templates_call_format_is_recognised(model, kind):
    template = ChatTemplate(realtemplates.from_llama_cpp()[model], **TOKENS)
    assert template.tool_format == kind == format_of(realtemplates.from_llama_cpp()[model], True)


def rendered_calls(model: str, calls: list) -> str:
    """What the template renders for an assistant message making `calls`, after the conversation
    before it: the text the model writes for them."""
    source = realtemplates.from_llama_cpp()[model]
    template = ChatTemplate(source, **TOKENS)
    before = [{"role": "user", "content": "Weather in Paris?"}]
    opened = template.render(before, True, Tools.of(TOOLS))
    whole = template.render([*before, {"role": "assistant", "content": "", "tool_calls": calls}], False,
                            Tools.of(TOOLS))
    assert whole.startswith(opened)
    written = whole[len(opened):].rstrip()
    for end in END_MARKS:  # the end of the turn: the model's end token, not part of its calls
        written = written.removesuffix(end)
    return written


def calls_of(model: str) -> list:
    return [CALL] if FORMATS[model] == "llama3" else [CALL, SECOND]


@pytest.mark.parametrize("model", sorted(FORMATS))
def test_what_a_template_renders_for_calls_is_read_back_as_those_calls(model):
    written = rendered_calls(model, calls_of(model))
    use = ToolUse.of(TOOLS, "auto", format=FORMATS[model])
    content, calls = use.parse(written, "seed")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls_of(model)]
    # streamed in pieces of any size: the same calls, the same ids, and no text
    for size in (1, 2, 3, 7, 1000):
        stream = use.stream("seed")
        text, streamed = "", []
        for start in range(0, len(written), size):
            piece_text, found = stream.feed(written[start:start + size])
            text += piece_text
            streamed += found
        piece_text, found = stream.finish()
        assert (text + piece_text, streamed + found) == ("", calls), (model, size)


@pytest.mark.parametrize("text", [
    "Sure, one moment.", "", "{not a call}", "Use <tool_call> tags, like <tool_call", "[1, 2]",
    '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
])
@pytest.mark.parametrize("kind", ["hermes", "llama3", "mistral", "mistral_args"])
def test_text_that_makes_no_call_streams_as_it_was_written(kind, text):
    use = ToolUse.of(TOOLS, "auto", format=kind)
    for size in (1, 4, 100):
        stream = use.stream("s")
        out = "".join(stream.feed(text[i:i + size])[0] for i in range(0, len(text), size))
        rest, calls = stream.finish()
        assert out + rest == text and calls == []
    assert use.parse(text, "s") == (text.strip() or None, [])


def test_text_around_a_call_is_the_content_and_a_call_in_the_middle_is_read():
    use = ToolUse.of(TOOLS, "auto", format="hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\nDone.'
    content, calls = use.parse(text, "s")
    assert content == "Let me check.\n\nDone." and [c.name for c in calls] == ["get_time"]
    stream = use.stream("s")
    pieces = [stream.feed(text[i:i + 5]) for i in range(0, len(text), 5)] + [stream.finish()]
    assert "".join(p[0] for p in pieces) == "Let me check.\n\nDone."
    assert [c for p in pieces for c in p[1]] == calls


@pytest.fixture(scope="module")
def grammars(tiny_models):
    """The grammar engine on the tiny model's vocabulary (llama.cpp's pieces)."""
    from engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(tiny_models["f32"].gguf, n_ctx=256, threads=1, threads_batch=1)
    tokenizer, described = engine.tokenizer(), engine.describe()
    yield Grammars(tokenizer.vocabulary, lambda text: tokenizer.tokenize(text, special=False),
                   described.eos_tokens, described.vocab_size), tokenizer
    engine.close()


@pytest.mark.parametrize("model", sorted(FORMATS))
def test_a_required_calls_grammar_accepts_what_the_template_renders_for_the_call(grammars, model):
    compiler, tokenizer = grammars
    written = rendered_calls(model, calls_of(model))
    use = ChatTemplate(realtemplates.from_llama_cpp()[model], **TOKENS).tool_use(TOOLS, "required", None, {})
    matching = compiler.compile(use.constraint()).start()
    for token in tokenizer.tokenize(written, special=False):  # (the tiny vocabulary has no [TOOL_CALLS]: text)
        assert matching.allowed()[token], (model, written)
        matching.advance(token)
    assert matching.finished or matching.allowed()[compiler.end_tokens[0]]
    # a call with an argument its schema refuses is not allowed
    wrong = written.replace('"C"', '"K"')
    refused = compiler.compile(use.constraint()).start()
    tokens = tokenizer.tokenize(wrong, special=False)
    assert not all(refused.allowed()[t] and (refused.advance(t) or True) for t in tokens)


def test_a_template_without_tools_gets_them_described_and_calls_written_out():
    template = ChatTemplate(None)  # ChatML, which reads no `tools`
    assert not template.takes_tools and template.tool_format == "hermes"
    text = template.render(CONVERSATIONS["one call and its result"], True, Tools.of(TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call the functions below")
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
            '\n</tool_call><|im_end|>') in text
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>' in text
    # with no system message, one is added first
    bare = template.render([{"role": "user", "content": "Hi"}], True, Tools.of(TOOLS))
    assert bare.startswith("<|im_start|>system\nYou may call") and "<|im_start|>user\nHi" in bare


def test_the_grammar_of_each_format_compiles():
    for kind in ("hermes", "llama3", "mistral", "mistral_args"):
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            grammar = ToolUse.of(TOOLS, choice, format=kind, markers={"[TOOL_CALLS]": 5}).grammar()
            assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == "", kind


FRAGMENTS = ["Hello", " ", "\n", "<think>\n\n</think>\n\n", "<tool", "_call>", "</tool_call>", "{", "}",
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}\n</tool_call>',
             '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "<", "tool_call", "x"]


@given(st.lists(st.sampled_from(FRAGMENTS), max_size=8), st.lists(st.integers(1, 30), min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_a_stream_cut_anywhere_reads_as_the_whole_reply_does(fragments, cuts):
    text = "".join(fragments)
    use = ToolUse.of(TOOLS, "auto", format="hermes")
    content, calls = use.parse(text, "s")
    stream, sent, streamed, at = use.stream("s"), "", [], 0
    for size in cuts * (len(text) // len(cuts) + 1):
        if at >= len(text):
            break
        piece, found = stream.feed(text[at:at + size])
        sent, streamed, at = sent + piece, streamed + found, at + size
    piece, found = stream.finish()
    sent, streamed = sent + piece, streamed + found
    assert streamed == calls
    assert sent.strip() == (content or "") if calls else sent == text
