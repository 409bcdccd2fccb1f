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
from superfluid.host.tools import ToolError, Tools, ToolUse
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
    assert template.takes_tools and template.tool_format == kind


@pytest.mark.parametrize("model", ["Qwen3 Coder", "GLM 4.6", "Command R7B", "Functionary 3.1"])
def test_a_template_writing_calls_in_a_format_not_read_here_gets_the_tools_described(model):
    # (Qwen3-Coder's and GLM's XML inside <tool_call>, Command-R's action list, Functionary's
    # <function=...>): the model is told the hermes format in a system message instead
    template = ChatTemplate(realtemplates.from_llama_cpp()[model], **TOKENS)
    assert not template.takes_tools and template.tool_format == "hermes"
    text = template.render([{"role": "user", "content": "Weather?"}], True, Tools.of(TOOLS))
    assert "You may call the functions below" in text and "<tool_call>" in text


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
    use = ToolUse.of(TOOLS, "auto", True, format=FORMATS[model])
    content, calls = use.parse(written, "seed")
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls_of(model)]
    # streamed in pieces of any size: the same calls, the same ids, and no text
    for size in (1, 2, 3, 7, 1000):
        stream = use.stream("seed")
        items = [item for start in range(0, len(written), size) for item in stream.feed(written[start:start + size])]
        assert items + stream.finish() == calls, (model, size)


@pytest.mark.parametrize("text", [
    "Sure, one moment.", "", "{not a call}", "Use <tool_call> tags, like <tool_call", "[1, 2]",
    '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
])
@pytest.mark.parametrize("kind", ["hermes", "llama3", "mistral", "mistral_args"])
def test_text_that_makes_no_call_streams_as_it_was_written(kind, text):
    use = ToolUse.of(TOOLS, "auto", format=kind)
    for size in (1, 4, 100):
        stream = use.stream("s")
        items = [item for i in range(0, len(text), size) for item in stream.feed(text[i:i + size])]
        items += stream.finish()
        assert all(isinstance(item, str) for item in items) and "".join(items) == text
    assert use.parse(text, "s") == (text.strip() or None, [])


def test_text_around_a_call_is_the_content_and_a_call_in_the_middle_is_read():
    use = ToolUse.of(TOOLS, "auto", format="hermes")
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\nDone.'
    content, calls = use.parse(text, "s")
    assert content == "Let me check.\n\nDone." and [c.name for c in calls] == ["get_time"]
    stream = use.stream("s")
    items = [item for i in range(0, len(text), 5) for item in stream.feed(text[i:i + 5])] + stream.finish()
    assert "".join(item for item in items if isinstance(item, str)) == "Let me check.\n\nDone."
    assert [item for item in items if not isinstance(item, str)] == calls
    # in the order written: the text before the call, the call, the text after it
    kinds = [isinstance(item, str) for item in items]
    assert kinds.index(False) > 0 and all(kinds[kinds.index(False) + 1:])


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
    use = ChatTemplate(realtemplates.from_llama_cpp()[model], **TOKENS).tool_use(TOOLS, "required", True, {})
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


@given(st.lists(st.sampled_from(FRAGMENTS), max_size=8), st.lists(st.integers(1, 30), min_size=1, max_size=40),
       st.booleans())
@settings(max_examples=300, deadline=None)
def test_a_stream_cut_anywhere_reads_as_the_whole_reply_does(fragments, cuts, parallel):
    text = "".join(fragments)
    use = ToolUse.of(TOOLS, "auto", parallel, format="hermes")
    content, calls = use.parse(text, "s")
    stream, items, at = use.stream("s"), [], 0
    for size in cuts * (len(text) // len(cuts) + 1):
        if at >= len(text):
            break
        items += stream.feed(text[at:at + size])
        at += size
    items += stream.finish()
    sent = "".join(item for item in items if isinstance(item, str))
    assert [item for item in items if not isinstance(item, str)] == calls
    assert sent.strip() == (content or "") if calls else sent == text


REFERRING = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                        "required": ["city"]}}}}}  # as Pydantic writes a model's schema


@pytest.mark.parametrize("model", sorted(FORMATS))
def test_a_tool_whose_parameters_refer_to_their_own_definitions_can_be_required(grammars, model):
    compiler, tokenizer = grammars
    template = ChatTemplate(realtemplates.from_llama_cpp()[model], **TOKENS)
    use = template.tool_use([REFERRING], "required", None, {})
    matching = compiler.compile(use.constraint()).start()  # the $ref resolves: it compiles
    call = {"id": "abcdefghi", "type": "function", "function": {"name": "book", "arguments": '{"where": {"city": "Oslo"}}'}}
    before = [{"role": "user", "content": "Book Oslo"}]
    opened = template.render(before, True, Tools.of([REFERRING]))
    written = template.render([*before, {"role": "assistant", "content": "", "tool_calls": [call]}], False,
                              Tools.of([REFERRING]))[len(opened):].rstrip()
    for end in END_MARKS:
        written = written.removesuffix(end)
    for token in tokenizer.tokenize(written, special=False):
        assert matching.allowed()[token], (model, written)
        matching.advance(token)


def test_a_tool_without_a_description_renders_on_templates_that_read_one():
    bare = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
    for model in ("Hermes 2 Pro", "Hermes 3"):
        text = ChatTemplate(realtemplates.from_llama_cpp()[model], **TOKENS).render(
            [{"role": "user", "content": "Hi"}], True, Tools.of([bare]))
        assert '"ping"' in text


def test_with_one_call_asked_for_a_reply_of_two_gives_the_first_whole_and_streamed():
    use = ToolUse.of(TOOLS, "auto", False, format="hermes")
    first = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    text = f'{first}\n{first.replace("UTC", "CET")}'
    content, calls = use.parse(text, "s")
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"zone": "UTC"}]
    stream = use.stream("s")
    items = [item for i in range(0, len(text), 7) for item in stream.feed(text[i:i + 7])] + stream.finish()
    assert items == calls
    llama = ToolUse.of(TOOLS, "auto", True, format="llama3")  # one call a turn, whatever is asked
    two = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {"zone": "CET"}}'
    assert len(llama.parse(two, "s")[1]) == 1


def test_text_after_an_unclosed_call_and_a_lone_python_tag_stay_text():
    use = ToolUse.of(TOOLS, "auto", format="hermes")
    content, calls = use.parse('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\nI will wait.', "s")
    assert content == "I will wait." and [c.name for c in calls] == ["get_time"]
    assert use.parse('<tool_call>\n{"name": "get_time", "arguments": {}} and more</tool_call>', "s")[1] == []
    assert ToolUse.of(TOOLS, "auto", format="llama3").parse("<|python_tag|>", "s") == ("<|python_tag|>", [])


def test_a_call_id_mistrals_model_wrote_is_kept():
    nemo = ToolUse.of(TOOLS, "auto", format="mistral")
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "Ab3dE6gH9"}]'
    assert [c.id for c in nemo.parse(text, "seed")[1]] == ["Ab3dE6gH9"]
    small = ToolUse.of(TOOLS, "auto", format="mistral_args")
    assert [c.id for c in small.parse('[TOOL_CALLS]get_time[CALL_ID]Zz9Zz9Zz9[ARGS]{"zone": "UTC"}', "s")[1]] == \
        ["Zz9Zz9Zz9"]
    made = nemo.parse('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "bad"}]', "seed")[1]
    assert len(made[0].id) == 9 and made[0].id.isalnum()  # not one a template takes: one made


def test_parameters_the_log_cannot_keep_are_refused_naming_them():
    huge = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 10 ** 20}}}}}
    with pytest.raises(ToolError, match="cannot be kept"):
        Tools.of([huge])
