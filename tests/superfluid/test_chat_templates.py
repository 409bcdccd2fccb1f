"""Chat templates render as transformers' apply_chat_template renders them (the environment model
templates are written against): the same text for the same conversation, template by template."""

import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from superfluid.host.chat import CHATML, ChatTemplate
from superfluid.host.errors import ChatError
from tests import realtemplates

CONVERSATION = [{"role": "system", "content": "Answer in one line. Ünïcödé & <tags> 'quoted'."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Japan? 日本"}]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

# Each exercises part of the environment: loop controls, transformers' tojson (no ASCII or HTML
# escaping, its indent and sort_keys), strftime_now, namespace(), the generation tag, trims.
FEATURES = {
    "loop controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "[{{ m.role }}]{{ m.content }}{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}",
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
    "strftime_now": "{{ strftime_now('%Y-%m') }}:{% for m in messages %}{{ m.content }}{% endfor %}",
    "namespace": "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
                 "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{{ ns.last_user }}",
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                      "{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
                      "{% if add_generation_prompt %}>>{% endif %}",
    "trim and lstrip": "{{ bos_token }}\n{% for m in messages %}\n    {{- m.role | upper }}: {{ m.content | trim }}\n"
                       "{% endfor %}\n{% if add_generation_prompt %}ASSISTANT:{% endif %}",
}


def llama_cpp_python_templates() -> dict:
    """The Jinja templates llama-cpp-python ships (read from the installed package at test time)."""
    from llama_cpp import llama_chat_format

    return {name: getattr(llama_chat_format, name) for name in dir(llama_chat_format) if name.endswith("_TEMPLATE")}


def transformers_render(source: str, messages: list, generation_prompt: bool) -> str:
    rendered, _ = render_jinja_template([messages], chat_template=source, add_generation_prompt=generation_prompt,
                                        **TOKENS)  # (one text per conversation, assistant masks)
    return rendered[0]


@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_the_environment_matches_transformers(name, generation_prompt):
    source = FEATURES[name]
    ours = ChatTemplate(source, **TOKENS).render(CONVERSATION, generation_prompt)
    assert ours == transformers_render(source, CONVERSATION, generation_prompt)
    if name == "tojson":
        assert "Ünïcödé & <tags> 'quoted'" in ours and json.loads(ours.split("|")[0]) == CONVERSATION


def test_the_templates_llama_cpp_python_ships_and_chatml_render_alike():
    templates = {**llama_cpp_python_templates(), "CHATML (ours)": CHATML}
    assert len(templates) >= 4
    for name, source in templates.items():
        for generation_prompt in (False, True):
            messages = CONVERSATION if "MISTRAL" not in name and "MIXTRAL" not in name else CONVERSATION[1:]
            ours = ChatTemplate(source, **TOKENS).render(messages, generation_prompt)
            assert ours == transformers_render(source, messages, generation_prompt), name


REAL_CONVERSATIONS = {
    "system and two turns": CONVERSATION,
    "one user message": CONVERSATION[1:2],
    "a reply with its reasoning": [{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "<think>\nThey greet me.\n</think>\n\nHello!"},
                                   {"role": "user", "content": "Bye"}],
}


def rendered_alike(source: str, messages: list, generation_prompt: bool) -> tuple[str, str]:
    """(ours, transformers') for one conversation; when the template reads the clock, ours is
    rendered before and after theirs and the one of the same day is returned (no test may fail
    because it ran across midnight). Where transformers' raises, ours must raise the same."""
    template = ChatTemplate(source, **TOKENS)
    try:
        theirs = transformers_render(source, messages, generation_prompt)
    except Exception as exc:  # noqa: BLE001 - the template's own refusal (raise_exception)
        with pytest.raises(ChatError) as ours:
            template.render(messages, generation_prompt)
        assert str(exc) in str(ours.value)
        return str(exc), str(exc)
    before = template.render(messages, generation_prompt)
    after = template.render(messages, generation_prompt) if before != theirs else before
    return (after if after == theirs else before), theirs


@pytest.mark.parametrize("model", sorted(realtemplates.TEMPLATE_FILES) + sorted(realtemplates.TEMPLATE_TEST_ENTRIES))
def test_real_models_templates_render_as_transformers_renders_them(model):
    source = realtemplates.from_llama_cpp()[model]
    for name, messages in REAL_CONVERSATIONS.items():
        for generation_prompt in (False, True):
            ours, theirs = rendered_alike(source, messages, generation_prompt)
            assert ours == theirs, f"{model}, {name}, generation prompt {generation_prompt}"


def test_a_template_that_refuses_a_conversation_is_a_chat_error_with_its_words():
    source = realtemplates.from_llama_cpp()["Gemma 2"]  # no system role in Gemma 2's template
    ours, theirs = rendered_alike(source, CONVERSATION, True)
    assert ours == theirs and "System role not supported" in ours


def test_raise_exception_is_a_chat_error_naming_the_templates_message():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('users speak first') }}{% endif %}")
    with pytest.raises(ChatError, match="users speak first"):
        template.render(CONVERSATION)
    with pytest.raises(Exception, match="users speak first"):
        transformers_render(template_source := "{{ raise_exception('users speak first') }}", CONVERSATION, False)
    assert template_source


def test_whatever_a_template_raises_on_a_conversation_is_a_chat_error_naming_it():
    # the template is the model's code: a TypeError inside it refuses these messages (a 400 over
    # HTTP), it is not a fault of the server's (a 500)
    template = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatError, match="TypeError"):
        template.render(CONVERSATION)


# Like Qwen3's: a past assistant turn loses its reasoning once a user speaks after it.
DROPS_PAST_REASONING = (
    "{% for m in messages %}{% set content = m.content %}"
    "{% if m.role == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_that_rewrites_past_turns_keeps_the_common_prefix(template_host):
    """A rewritten assistant turn: the session keeps the tokens (and KV) up to the rewrite, and
    then holds exactly what the whole conversation renders to, as a cold session would."""
    host = template_host(DROPS_PAST_REASONING)
    session = host.session()
    session.append_user("Hello there")
    session.append_assistant("<think>long reasoning here</think>Hi!")
    before = session.tokens
    session.append_user("How are you?")
    messages = [{"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "<think>long reasoning here</think>Hi!"},
                {"role": "user", "content": "How are you?"}]
    assert session.messages == messages
    whole = host.call(lambda: host.commands.engine.tokenize(
        ChatTemplate(DROPS_PAST_REASONING).render(messages), special=True))
    assert session.tokens == whole  # what the whole conversation renders to
    common = next(i for i, (a, b) in enumerate(zip(before, whole)) if a != b)
    assert session.tokens[:common] == before[:common] and len(whole) < len(before) + 8
    generated = session.generate(max_tokens=4, ignore_eos=True)
    generated.collect()
    prompt = session.tokens[:len(whole)] + host.call(lambda: host.commands.engine.tokenize(
        "<|im_start|>assistant\n", special=True))
    cold = host.session()
    cold.append_tokens(prompt)
    assert cold.complete(max_tokens=4, ignore_eos=True) == generated.text  # as a cold session on those tokens


def test_many_messages_at_once_on_a_template_that_rewrites_past_turns_hold_what_the_whole_renders(template_host):
    host = template_host(DROPS_PAST_REASONING)
    session = host.session()
    session.append_user("Hello there")
    session.append_assistant("<think>long reasoning here</think>Hi!")
    more = [("user", "How are you?")] + [("assistant" if i % 2 == 0 else "user", f"<think>x</think>turn {i}")
                                         for i in range(11)]
    host.call(host.commands.append_messages, session.id, more)  # past 8: rendered once, with a rewrite
    messages = [{"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "<think>long reasoning here</think>Hi!"}]
    messages += [{"role": role, "content": content} for role, content in more]
    assert session.messages == messages
    assert session.tokens == host.call(lambda: host.commands.engine.tokenize(
        ChatTemplate(DROPS_PAST_REASONING).render(messages), special=True))


# Renders an assistant's reply otherwise than the model wrote it, as templates that strip
# reasoning or trim replies do: the turn cannot be closed by appending.
SHOUTS_REPLIES = ("{% for m in messages %}{% set content = m.content | upper if m.role == 'assistant' else m.content %}"
                  "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_reply_the_template_renders_otherwise_is_rerendered_when_its_turn_closes(template_host):
    host = template_host(SHOUTS_REPLIES)
    session = host.session()
    session.append_user("say something")
    reply = session.complete(max_tokens=8, ignore_eos=True)
    assert reply != reply.upper()  # the tiny model writes lower case: the template changes it
    messages = [{"role": "user", "content": "say something"}, {"role": "assistant", "content": reply}]
    assert session.messages == messages
    whole = host.call(lambda: host.commands.engine.tokenize(ChatTemplate(SHOUTS_REPLIES).render(messages),
                                                            special=True))
    assert session.tokens == whole  # the session holds what the template renders, not the raw reply
    session.append_user("again")  # and grows from there
    assert session.messages[-1] == {"role": "user", "content": "again"}


@pytest.mark.parametrize("model", ["Llama 3.1", "Qwen 2.5", "Qwen 3", "Mistral Nemo", "Phi 4", "Gemma 2"])
def test_a_conversation_on_a_real_template_holds_what_transformers_renders(template_host, model):
    """Turns appended one at a time and a generated reply: the session's text is what
    transformers renders for the whole conversation (a template that rewrites a past turn, as
    Qwen 3's drops past reasoning, is rendered whole and the common prefix kept)."""
    source = realtemplates.from_llama_cpp()[model]
    host = template_host(source)
    tokens = host.call(lambda: host.commands.template().special_tokens)
    for name, messages in REAL_CONVERSATIONS.items():
        if model == "Gemma 2" and messages[0]["role"] == "system":
            continue  # its template refuses a system message (tested above)
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        session = host.session(system=system)
        for message in messages[1:] if system else messages:
            session.append_message(message["role"], message["content"])
        reply = session.complete(max_tokens=4, ignore_eos=True)
        whole = [*messages, {"role": "assistant", "content": reply}]
        assert session.messages == whole, (model, name)
        ours = session.detokenize(session.tokens)
        theirs, _ = render_jinja_template([whole], chat_template=source, add_generation_prompt=False, **tokens)
        assert ours == theirs[0], (model, name)
