"""A request carrying a conversation's whole history is rendered a new message at a time (a long
new history once, whole): the tokens are those appending each message in turn gives, the history
a recent request sent is not rendered again, and what the template is handed grows linearly."""

import pytest

from superfluid.host.chat import ChatTemplate, TemplateRewrites
from superfluid.host.conversation_cache import SEPARATE_RENDERS, ConversationCache
from superfluid.host.request import GenerateRequest, Prompt
from tests import realtemplates
from tests.superfluid.test_chat_templates import DROPS_PAST_REASONING, REAL_CONVERSATIONS, TOKENS


def characters(text: str) -> list[int]:
    """A tokenizer whose tokens show exactly which text was tokenized."""
    return [ord(c) for c in text]


def one_at_a_time(template: ChatTemplate, messages) -> list[list[int]]:
    """Each message's tokens as a session appending them in turn gets them (ChatTemplate.turn)."""
    as_dicts = [{"role": role, "content": content} for role, content in messages]
    return [characters(template.turn(as_dicts[:i], message)) for i, message in enumerate(as_dicts)]


def conversation(turns: int) -> list[tuple[str, str]]:
    """A system message, then `turns` questions and answers."""
    out = [("system", "Be brief.")]
    for i in range(turns):
        out += [("user", f"Question {i}?"), ("assistant", f"Answer {i}.")]
    return out


def test_each_request_renders_only_what_follows_the_history_a_recent_one_sent():
    template = ChatTemplate(None)
    cache = ConversationCache(template, characters)
    history = conversation(0)
    for turn in range(20):
        history = [*history, ("user", f"Question {turn}?")]
        before = cache.rendered
        assert list(cache.tokens(history)) == one_at_a_time(template, history)
        # the first request renders its 2 messages; each later one the reply and the question
        assert cache.rendered - before == 2
        history = [*history, ("assistant", f"Answer {turn}.")]
    before = cache.rendered
    again = history[:-1]  # the same request again (a retry): nothing rendered
    assert list(cache.tokens(again)) == one_at_a_time(template, again) and cache.rendered == before


def test_a_history_another_tenant_sent_is_rendered_in_full():
    # the time a rendering takes would otherwise tell a client whether another tenant sent it
    template = ChatTemplate(None)
    cache = ConversationCache(template, characters)
    history = conversation(3)
    cache.tokens(history, "alice")
    before = cache.rendered
    assert list(cache.tokens([*history, ("user", "More?")], "bob#salt")) == one_at_a_time(
        template, [*history, ("user", "More?")])
    assert cache.rendered - before == len(history) + 1
    before = cache.rendered
    cache.tokens([*history, ("user", "More?")], "alice")
    assert cache.rendered - before == 1


def test_a_short_new_conversation_is_rendered_a_message_at_a_time():
    template = ChatTemplate(None)
    cache = ConversationCache(template, characters)
    history = conversation(3)  # 7 messages: each gets its own tokens, as appending them in turn gives
    assert len(history) <= SEPARATE_RENDERS
    assert list(cache.tokens(history)) == one_at_a_time(template, history)
    assert cache.rendered == len(history)


@pytest.mark.parametrize("turns", [40, 400, 4000])
def test_the_messages_handed_to_the_template_grow_linearly_with_the_conversation(turns):
    template = ChatTemplate(None)
    cache = ConversationCache(template, characters)
    history = conversation(turns) + [("user", "And now?")]
    pieces = cache.tokens(history)
    # a long new history is rendered once, whole: its messages end where the one piece ends
    assert template.messages_rendered == len(history)
    assert [token for piece in pieces for token in piece] == characters(template.render(
        [{"role": role, "content": content} for role, content in history]))
    assert all(piece == [] for piece in pieces[:-1])
    # the next request (the reply and a question) renders the history twice more, never per message
    template.messages_rendered = 0
    following = history + [("assistant", "Fine."), ("user", "Why?")]
    assert list(cache.tokens(following))[:len(history)] == list(pieces)
    assert template.messages_rendered == 2 * len(history) + 3


def test_it_keeps_the_most_recently_used_conversations_only():
    cache = ConversationCache(ChatTemplate(None), characters, conversations=2)
    first, second, third = ([("user", f"Conversation {i}")] for i in range(3))
    for history in (first, second, first, third):  # `second` is the least recently used when `third` comes
        cache.tokens(history)
    rendered = cache.rendered
    cache.tokens(first)
    cache.tokens(third)
    assert cache.rendered == rendered
    cache.tokens(second)
    assert cache.rendered == rendered + 1


@pytest.mark.parametrize("model", ["Llama 3.1", "Qwen 2.5", "Qwen 3", "Mistral Nemo", "Phi 4", "Gemma 2"])
def test_real_templates_give_the_tokens_of_one_message_at_a_time(model):
    template = ChatTemplate(realtemplates.from_llama_cpp()[model], **TOKENS)
    for name, messages in REAL_CONVERSATIONS.items():
        if model == "Gemma 2" and messages[0]["role"] == "system":
            continue  # its template refuses a system message
        history = [(m["role"], m["content"]) for m in messages]
        cache = ConversationCache(template, characters)
        try:
            expected = one_at_a_time(template, history)
        except TemplateRewrites:  # Qwen 3 drops a past reply's reasoning: the cache says so too
            with pytest.raises(TemplateRewrites):
                cache.tokens(history)
            continue
        for n in range(1, len(history) + 1):  # request by request, as a client grows it
            assert list(cache.tokens(history[:n])) == expected[:n], (model, name, n)


def one_shot(host, messages):
    """A chat request on `messages` on a request lane of its own (1 token), run to its end; the
    state its lane held (taken as it started: the lane ends with its generation)."""
    prompt = host.prepare(Prompt(tuple(messages)))

    def start():
        lane_id, generation = host.commands.start_request(prompt, GenerateRequest(max_tokens=1,
                                                                                   sampling={"temperature": 0.0}))
        return host.commands.sessions.requests[lane_id].state, generation

    state, generation = host.call(start)
    generation.collect()
    return state


def test_a_request_holds_what_appending_its_messages_in_turn_holds(open_host):
    host = open_host()
    history = conversation(5) + [("user", "And now?")]
    one_shot(host, history[:5])  # an earlier request of the same conversation (what follows it: one by one)
    state = one_shot(host, history)
    assert host.prompts.conversations.rendered == len(history)  # each message once
    session = host.session()
    for role, content in history:
        session.append_message(role, content)
    one_by_one = host.call(lambda: host.commands.sessions.get(session.id).state)
    # then come the generation prompt, the token generated, and the reply's message
    assert state.tokens[:len(one_by_one.tokens)] == one_by_one.tokens
    assert state.message_ends[:len(history)] == one_by_one.message_ends
    assert state.messages[:len(history)] == one_by_one.messages


def test_a_request_on_a_template_that_rewrites_past_turns_holds_what_the_whole_renders(template_host):
    host = template_host(DROPS_PAST_REASONING)
    history = [("user", "Hello there"), ("assistant", "<think>long reasoning here</think>Hi!"),
               ("user", "How are you?")]
    state = one_shot(host, history)
    messages = [{"role": role, "content": content} for role, content in history]
    whole = host.call(lambda: host.commands.engine.tokenize(
        ChatTemplate(DROPS_PAST_REASONING).render(messages, generation_prompt=True), special=True))
    assert state.tokens[:len(whole)] == whole and state.messages[:3] == messages


class Dated(ChatTemplate):
    """ChatML opened by the day it is rendered on, as templates that write today's date are."""

    day = 1

    def render(self, messages, generation_prompt=False, tools=None):
        """The day, then ChatML."""
        return f"day {self.day}\n" + super().render(messages, generation_prompt, tools)


def test_a_history_that_no_longer_renders_alike_is_forgotten():
    template = Dated(None)
    cache = ConversationCache(template, characters)
    history = conversation(2)
    cache.tokens(history)
    template.day = 2  # midnight: the kept rendering no longer starts the conversation's rendering
    longer = [*history, ("user", "And tomorrow?")]
    with pytest.raises(TemplateRewrites):
        cache.tokens(longer)  # the session then takes the messages one at a time
    assert list(cache.tokens(longer)) == one_at_a_time(template, longer)  # rendered anew, not refused again
