"""prefixrt/lowering/tool_formats.py: each family's tool-call syntax, as those models write it, read back into calls; a
template's family detected from its text; anything else left as prose."""

from __future__ import annotations

import pytest

from prefixrt.lowering.tool_formats import detect, may_be_call, parse

NAMES = {"get_weather", "add"}
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
ADD = ("add", {"a": 2, "b": 3})

CALLS = [
    # Qwen 2.5/3, Hermes
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     [PARIS]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', [PARIS, ADD]),
    # Llama 3.1/3.2 JSON tool calling, with and without <|python_tag|>, several calls separated by ';'
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', [PARIS]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', [PARIS]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
               '{"name": "add", "parameters": {"a": 2, "b": 3}}', [PARIS, ADD]),
    # Mistral v3 (JSON array after [TOOL_CALLS]; the special token may be decoded away) and v11+ ([ARGS])
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "add", "arguments": {"a": 2, "b": 3}}]', [PARIS, ADD]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}',
     [PARIS, ADD]),
    # Gemma 3's documented form (a ```tool_code block) and the pythonic list (Llama 3.2, Gemma templates)
    ("pythonic", '```tool_code\nget_weather(city="Paris", unit="celsius")\n```', [PARIS]),
    ("pythonic", '```tool_code\nprint(get_weather(city="Paris", unit="celsius"))\n```', [PARIS]),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), add(a=2, b=3)]', [PARIS, ADD]),
]


@pytest.mark.parametrize("family,text,want", CALLS)
def test_calls_read_back(family, text, want):
    assert parse(family, text, NAMES) == want
    for k in range(1, len(text)):  # while a call streams in, its every prefix may still be one
        assert may_be_call(family, text[:k], NAMES), text[:k]


PROSE = [
    ("hermes", "The weather in Paris is mild."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut short
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # an undeclared tool
    ("llama3", "It is sunny."),
    ("llama3", '{"name": "get_weather", "parameters": "Paris"}'),
    ("mistral", "[1, 2, 3]"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": '),
    ("pythonic", "Paris is sunny today."),
    ("pythonic", '```tool_code\nimport os; os.system("x")\n```'),
    ("pythonic", "[get_weather(city=input())]"),  # arguments must be literals: never evaluated
]


@pytest.mark.parametrize("family,text", PROSE)
def test_anything_else_is_not_a_call(family, text):
    assert parse(family, text, NAMES) is None


@pytest.mark.parametrize("family,text", [("hermes", "Sure, here"), ("llama3", "It is"), ("mistral", "The"),
                                         ("pythonic", "Paris")])
def test_prose_streams_at_once(family, text):
    assert not may_be_call(family, text, NAMES)


LLAMA31 = ('{{- bos_token }}{%- if tools is not none %}<|start_header_id|>user<|end_header_id|>\n\nGiven the '
           'following functions, please respond with a JSON for a function call with its proper arguments that best '
           'answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of '
           'argument name and its value}.{%- endif %}<|python_tag|>')
MISTRAL = "{%- if tools %}[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"
QWEN = "{%- if tools %}<tools>{{ tools }}</tools> <tool_call>{%- endif %}"
GEMMA3 = "{{ bos_token }}{%- for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>{%- endfor %}"


def test_template_family():
    assert detect(QWEN) == "hermes" and detect(LLAMA31) == "llama3" and detect(MISTRAL) == "mistral"
    assert detect(GEMMA3) is None and detect(None) is None  # Gemma 3's own template renders no tools
    assert detect("{%- if tools %}[func_name1(params_name1=params_value1)]{%- endif %}") == "pythonic"
