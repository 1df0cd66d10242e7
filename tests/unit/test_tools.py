"""Tool calling's pure parts (coordinator/api/tools): OpenAI's tools and tool_choice parsed and refused by
name, each family's format found in its template, a conversation with calls and results rendered, the
answer parsed as a whole and as a stream split at every character, and the forced-call grammar compiled
and followed by llguidance over the demo's real tokenizer. Through a real fleet: tests/compat/test_tools.py."""

from __future__ import annotations

import json

import llguidance
import pytest

from coordinator.errors import InvalidRequest
from coordinator.tokenizer import ChatTokenizer
from coordinator.api.tool_chat import ToolAnswer
from coordinator.api.tools import (
    DEFAULT,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    ToolFormat,
    detect_format,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    render_messages,
    tool_constraint,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now"}}
TOOLS = parse_tools([WEATHER, CLOCK])
HERMES, LLAMA3, MISTRAL = ToolFormat("hermes", True), ToolFormat("llama3", True), ToolFormat("mistral", True)
CALLS = [ToolCall("a", "get_weather", '{"city": "Paris", "unit": "celsius"}'), ToolCall("b", "now", "{}")]


def test_tools_parse_from_openai_shapes():
    (weather, clock) = TOOLS
    assert weather.name == "get_weather" and weather.parameters["required"] == ["city"]
    assert clock.description == "" and clock.parameters == {"type": "object", "properties": {}}
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto") and parse_tool_choice(None, ()).mode == "none"
    assert parse_tool_choice("required", TOOLS).forced
    named = parse_tool_choice({"type": "function", "function": {"name": "now"}}, TOOLS)
    assert named == ToolChoice("function", "now") and named.forced


@pytest.mark.parametrize("tools, why", [
    ([{"type": "custom", "custom": {"name": "x"}}], "'custom'"),
    ([WEATHER, WEATHER], "two tools are named 'get_weather'"),
    ([{"type": "function", "function": {"name": "bad name"}}], "function name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "type 'object'"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "must be a JSON schema"),
    ("get_weather", "must be a list"),
])
def test_bad_tools_are_refused_naming_the_field(tools, why):
    with pytest.raises(InvalidRequest, match=why) as caught:
        parse_tools(tools)
    assert caught.value.param == "tools"


@pytest.mark.parametrize("choice, tools, why", [
    ("sometimes", TOOLS, "must be 'none', 'auto', 'required'"),
    ({"type": "function", "function": {"name": "fly"}}, TOOLS, "'fly', which is not among the tools"),
    ("required", (), "has no tools"),
    ({"type": "allowed_tools"}, TOOLS, "'allowed_tools' is not supported"),
    ({"type": "function"}, TOOLS, "a function choice is"),
])
def test_bad_tool_choices_are_refused_naming_the_field(choice, tools, why):
    with pytest.raises(InvalidRequest, match=why) as caught:
        parse_tool_choice(choice, tools)
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize("template, fmt", [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n", HERMES),
    ("{%- if tools %}<|python_tag|>{% endif %}{{ 'ipython' }}", LLAMA3),
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", MISTRAL),
    (None, DEFAULT),
])
def test_the_format_is_found_in_the_template(template, fmt):
    assert detect_format(template) == fmt


def test_the_demo_template_gets_the_default_format(demo_hf):
    tokenizer = ChatTokenizer(demo_hf)
    assert detect_format(tokenizer.chat_template, "llama") == DEFAULT
    assert detect_format("[TOOL_CALLS] {{ tools }}", "mistral", {"[TOOL_CALLS]": 5}).call_token == 5


def conversation() -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris, and the time?"},
            {"role": "assistant", "content": "", "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "a", "content": '{"temperature": 21}'},
            {"role": "tool", "tool_call_id": "b", "content": "12:00"}]


def test_the_default_rendering_puts_tools_calls_and_results_in_plain_turns(demo_hf):
    """SmolLM2's template knows no tools: the definitions go into the system prompt, calls into the
    assistant's text, the two results into one user turn (templates that need alternating roles)."""
    messages, variables = render_messages(conversation(), TOOLS, DEFAULT)
    assert variables == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == DEFAULT.calls_text(CALLS)
    assert messages[3]["content"] == ('<tool_response>\n{"temperature": 21}\n</tool_response>\n'
                                      "<tool_response>\n12:00\n</tool_response>")
    prompt = ChatTokenizer(demo_hf).render_chat(messages, **variables)
    assert prompt.startswith("<|im_start|>system\nYou can call") and prompt.endswith("<|im_start|>assistant\n")
    quiet, _ = render_messages(conversation(), TOOLS, DEFAULT, offer=False)  # tool_choice none: no offer
    assert quiet[0]["role"] == "user" and quiet[1]["content"] == messages[2]["content"]


# the conventions of templates that know tools (Qwen's, transformers'): tools=, calls with function.arguments
# as objects, results with tool_call_id
NATIVE = ("{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% for m in messages %}"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
          "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
          "{% elif m.role == 'tool' %}[{{ m.tool_call_id }} {{ m.name }}: {{ m.content }}]"
          "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}")


def test_a_native_template_gets_tools_and_calls_as_transformers_gives_them(demo_hf, tmp_path):
    config = json.loads((demo_hf / "tokenizer_config.json").read_text())
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((demo_hf / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NATIVE}))
    messages, variables = render_messages(conversation(), TOOLS, detect_format(NATIVE))
    assert variables["tools"][0] == WEATHER
    prompt = ChatTokenizer(tmp_path).render_chat(messages, **variables)
    assert prompt.startswith(json.dumps(WEATHER) + "\n")  # tojson keeps the key order, escapes no '<'
    assert '<tool_call>get_weather {"city": "Paris", "unit": "celsius"}</tool_call><tool_call>now {}</tool_call>' \
        in prompt
    assert prompt.endswith('[a get_weather: {"temperature": 21}][b now: 12:00]')


def stream(fmt: ToolFormat, text: str, step: int = 1, names=None) -> tuple[str, list[ToolCall], dict]:
    """``text`` fed ``step`` characters at a time: the content, the calls, and each call's argument pieces joined."""
    parser = ToolCallParser(fmt, names, call_id=iter("xyz").__next__)
    deltas = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    pieces: dict[int, str] = {}
    for delta in deltas:
        for call in delta.calls:
            assert (call.id is None) == (call.name is None) and (call.id is None or call.arguments == "")
            pieces[call.index] = pieces.get(call.index, "") + call.arguments
    return "".join(d.content for d in deltas), parser.calls, pieces


@pytest.mark.parametrize("fmt, text, content", [
    (HERMES, ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'), "Sure.\n"),
    (LLAMA3, (' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
             '{"name": "now", "parameters": {}}'), ""),
    (MISTRAL, (' [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
              '{"name": "now", "arguments": {}}]'), ""),
    (MISTRAL, ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
              '{"name": "now", "arguments": {}}]'), ""),
])
@pytest.mark.parametrize("step", [1, 2, 7, 10_000])
def test_calls_parse_alike_streamed_in_any_pieces_and_whole(fmt, text, content, step):
    got_content, calls, pieces = stream(fmt, text, step)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(c.name, json.loads(c.arguments)) for c in CALLS]
    assert pieces == {i: c.arguments for i, c in enumerate(calls)}
    assert [c.id for c in calls] == ["x", "y"]
    assert parse_tool_calls(text, fmt)[0] == content


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "Paris is sunny. <tool_c is no tag, nor is <tool_call>this</tool_call>."),
    (HERMES, '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>'),  # not a tool offered
    (LLAMA3, '{"answer": 42} is JSON, no call'),
    (LLAMA3, 'Use {"name": "x", "parameters": {}} later'),
    (MISTRAL, "[1, 2] is a list"),
])
@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_text_that_is_no_call_stays_content(fmt, text, step):
    assert stream(fmt, text, step, names={"get_weather", "now"})[:2] == (text, [])


def test_a_call_cut_short_keeps_what_it_has():
    """max_tokens mid-call: the call is there with its arguments so far (finish_reason stays "length")."""
    content, calls, pieces = stream(HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', 3)
    assert content == "" and calls == [ToolCall("x", "get_weather", '{"city": "Pa')] and pieces[0] == '{"city": "Pa'
    assert stream(HERMES, "<tool_call>\n{\"na", 2)[:2] == ("<tool_call>\n{\"na", [])


@pytest.fixture(scope="module")
def lltokenizer(demo_hf):
    return ChatTokenizer(demo_hf), llguidance.LLTokenizer((demo_hf / "tokenizer.json").read_text(), n_vocab=49152)


@pytest.mark.parametrize("fmt", [DEFAULT, LLAMA3, MISTRAL, ToolFormat("mistral", True, call_token=2)])
@pytest.mark.parametrize("choice, parallel", [(ToolChoice("required"), None), (ToolChoice("required"), False),
                                              (ToolChoice("required"), True), (ToolChoice("function", "now"), None)])
def test_the_forced_call_grammar_takes_exactly_the_formats_calls(lltokenizer, fmt, choice, parallel):
    tokenizer, lltok = lltokenizer
    constraint = tool_constraint(TOOLS, choice, parallel, fmt)
    assert constraint.kind == "lark" and constraint.field == "tool_choice"
    grammar = constraint.grammar()
    assert llguidance.LLMatcher.validate_grammar(grammar, lltok) == ""
    # several forced calls only when asked for: else a small model repeats its call until max_tokens
    many = choice.mode == "required" and parallel is True and fmt.syntax != "llama3"
    calls = CALLS[1:] if choice.mode == "function" else CALLS if many else CALLS[:1]
    text = fmt.calls_text(calls).removeprefix("[TOOL_CALLS]")
    ids = ([2] if fmt.call_token is not None else []) + tokenizer.encode(text)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, fmt)[1]] == [(c.name, c.arguments) for c in calls]
    for bad in ('{"city": 3}', '{"city": "Paris", "wind": 1}', '{"unit": "celsius"}'):  # against the schema
        if choice.mode != "function":
            wrong = fmt.calls_text([ToolCall("a", "get_weather", bad)]).removeprefix("[TOOL_CALLS]")
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            prefix = [2] if fmt.call_token is not None else []
            assert not (matcher.consume_tokens(prefix + tokenizer.encode(wrong)) and matcher.is_accepting())
    assert tool_constraint(TOOLS, ToolChoice("auto"), None, fmt) is None


def accepts(lltokenizer, grammar: str, text: str, prefix: tuple[int, ...] = ()) -> bool:
    tokenizer, lltok = lltokenizer
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    return matcher.consume_tokens([*prefix, *tokenizer.encode(text)]) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", [DEFAULT, LLAMA3, MISTRAL])
def test_auto_with_a_strict_tool_allows_prose_or_calls_under_the_schema(lltokenizer, fmt):
    """OpenAI's ``strict``: under ``auto`` the model may answer in prose, but a call it makes follows the
    schema (prose holds no call: Hermes' has no tag, Llama 3's and Mistral's does not open like a call)."""
    strict = parse_tools([{**WEATHER, "function": {**WEATHER["function"], "strict": True}}, CLOCK])
    assert strict[0].strict and not strict[1].strict
    assert tool_constraint(TOOLS, ToolChoice("auto"), None, fmt) is None  # no strict tool: free text
    grammar = tool_constraint(strict, ToolChoice("auto"), None, fmt).grammar()
    lead = "Let me look. " if fmt.syntax == "hermes" else ""
    for text in ("Paris is sunny today.", "", "  ", lead + fmt.calls_text(CALLS[:1]).removeprefix("[TOOL_CALLS]")):
        assert accepts(lltokenizer, grammar, text), text
        assert [c.name for c in parse_tool_calls(text, fmt)[1]] == (["get_weather"] if "get_weather" in text else [])
    bad = fmt.calls_text([ToolCall("a", "get_weather", '{"town": "Paris"}')]).removeprefix("[TOOL_CALLS]")
    assert not accepts(lltokenizer, grammar, bad)
    assert not accepts(lltokenizer, grammar, lead + fmt.calls_text([ToolCall("a", "fly", "{}")]).removeprefix("[TOOL_CALLS]"))
    with pytest.raises(InvalidRequest, match="strict must be"):
        parse_tools([{**CLOCK, "function": {**CLOCK["function"], "strict": "yes"}}])


def test_the_openai_answer_spells_calls_as_openai_does():
    """tool_chat.ToolAnswer: the whole message (content null beside calls), the streamed deltas (the
    call's first item with id, type and name, then argument pieces), finish_reason "tool_calls"; a forced
    answer cut off mid-call has no content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    whole = ToolAnswer(DEFAULT, TOOLS, ToolChoice("auto"), None)
    message = whole.whole(text)["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    streamed = ToolAnswer(DEFAULT, TOOLS, ToolChoice("auto"), None)
    deltas = [streamed.piece(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
    items = [item for d in deltas if d for item in d["delta"].get("tool_calls", ())]
    assert items[0]["id"] == streamed.parser.calls[0].id and items[0]["type"] == "function"
    assert items[0]["function"]["name"] == "get_weather" and all("id" not in i for i in items[1:])
    assert "".join(i["function"]["arguments"] for i in items) == '{"city": "Paris"}'
    assert not any("content" in d["delta"] for d in deltas if d)
    forced = ToolAnswer(DEFAULT, TOOLS, ToolChoice("required"), None)
    assert forced.constraint is not None and forced.whole(text + "\n<tool_")["message"]["content"] is None
    prose = ToolAnswer(DEFAULT, TOOLS, ToolChoice("none"), None)
    assert prose.constraint is None and prose.whole(text)["message"] == {"role": "assistant", "content": text}
    assert prose.finish_reason("stop") == "stop"
