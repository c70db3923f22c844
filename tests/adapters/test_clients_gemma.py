"""Ecosystem clients against `prefixrt serve --model gemma-3-270m`, each used as its documentation says with
nothing prefixrt-specific: LangChain's ChatOpenAI structured output (pydantic, TypedDict, json_mode),
instructor (TOOLS, JSON_SCHEMA, Iterable[...]), `openai.pydantic_function_tool` with a nested model, tool
calls under a forced and the "auto" tool_choice, and openai-agents' default (Responses) model running a
function-tool agent. Each structured-output case runs 20 extraction inputs and counts the schema-valid results:
the acceptance figure is 20 of 20 (issue 14; the measured counts are in docs/adapters.md).

The schemas are what a user writes (no length bounds): constrained decoding closes every object, so the
model cannot invent keys, and a trained model ends its strings. One Gemma server for the whole session
(`gemma_server`, shared with tests/adapters/test_dspy.py); greedy decoding, max_tokens just above the longest
reply these inputs need.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypedDict

import jsonschema
import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")

GEMMA = "gemma-3-270m"

PEOPLE = [
    ("Alice is 30 and lives in Paris, France.", "Alice", 30),
    ("Bob, aged 42, is from Berlin in Germany.", "Bob", 42),
    ("Carla is a 25 year old living in Rome, Italy.", "Carla", 25),
    ("Dmitri (57) lives in Moscow, Russia.", "Dmitri", 57),
    ("Emma is 19; her home is Madrid, Spain.", "Emma", 19),
    ("Farid, 33, lives in Cairo in Egypt.", "Farid", 33),
    ("Greta is 61 and lives in Oslo, Norway.", "Greta", 61),
    ("Hiro is 28 and lives in Tokyo, Japan.", "Hiro", 28),
    ("Ines, 45 years old, lives in Lisbon, Portugal.", "Ines", 45),
    ("Jack is 37 and lives in Dublin, Ireland.", "Jack", 37),
    ("Kofi is 50; he lives in Accra, Ghana.", "Kofi", 50),
    ("Lena, 22, is from Vienna, Austria.", "Lena", 22),
    ("Marco is 39 and lives in Milan, Italy.", "Marco", 39),
    ("Nina is 27 and lives in Warsaw, Poland.", "Nina", 27),
    ("Omar, aged 64, lives in Amman, Jordan.", "Omar", 64),
    ("Priya is 31 and lives in Delhi, India.", "Priya", 31),
    ("Quinn is 48 and lives in Toronto, Canada.", "Quinn", 48),
    ("Rosa, 35, lives in Lima, Peru.", "Rosa", 35),
    ("Sven is 53 and lives in Stockholm, Sweden.", "Sven", 53),
    ("Tara is 24 and lives in Sydney, Australia.", "Tara", 24),
]
assert len(PEOPLE) == 20


class City(BaseModel):
    name: str
    country: str


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str
    age: int
    city: City


class PersonDict(TypedDict):
    """A person mentioned in the text."""

    name: str
    age: int


class Contact(BaseModel):
    name: str
    age: int


def closed(schema: dict) -> dict:
    """`schema` with every object closed (additionalProperties false, recursively): the validation oracle for
    "no keys outside the schema"."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def extract_prompt(text: str) -> str:
    return f"Extract the person from this text: {text}"


@pytest.fixture(scope="module")
def url(gemma_server) -> str:
    return gemma_server + "/v1"


@pytest.fixture(scope="module")
def oai(url):
    c = openai.OpenAI(base_url=url, api_key="test", max_retries=0)
    yield c
    c.close()


def chat_openai(url: str, max_tokens: int):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=url, api_key="test", model=GEMMA, max_tokens=max_tokens,
                                       temperature=0, max_retries=0)


def outcomes(check, inputs) -> tuple[int, list[str]]:
    """Run `check(input)` for every input at once (threads: the server batches them, as it would a user's
    concurrent calls) -> (how many returned True, a description of each other outcome). An exception is a
    failure of that call and is counted, not raised."""

    def one(item):
        try:
            return check(item)
        except Exception as e:  # noqa: BLE001 - a failure to parse or validate is what is counted
            return f"{item!r}: {type(e).__name__}: {e}"

    with ThreadPoolExecutor(max_workers=len(inputs)) as pool:
        results = list(pool.map(one, inputs))
    failures = [r if isinstance(r, str) else f"{item!r}: {r!r}" for item, r in zip(inputs, results) if r is not True]
    return len(results) - len(failures), failures


# ---------------------------------------------------------------------------------------------- LangChain

TEXTS = [text for text, _, _ in PEOPLE]


def test_langchain_structured_output_pydantic(url):
    llm = chat_openai(url, max_tokens=40).with_structured_output(Person)  # method="json_schema" (the default)
    valid, failures = outcomes(lambda text: isinstance(llm.invoke(extract_prompt(text)), Person), TEXTS)
    assert valid == 20, failures


def test_langchain_structured_output_typeddict(url):
    llm = chat_openai(url, max_tokens=24).with_structured_output(PersonDict)
    schema = closed({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})

    def check(text):
        jsonschema.validate(llm.invoke(extract_prompt(text)), schema)
        return True

    valid, failures = outcomes(check, TEXTS)
    assert valid == 20, failures


def test_langchain_structured_output_json_mode(url):
    """method="json_mode": response_format json_object (LangChain sends no schema); LangChain parses the reply as
    a JSON object."""
    llm = chat_openai(url, max_tokens=40).with_structured_output(None, method="json_mode")
    valid, failures = outcomes(
        lambda text: isinstance(llm.invoke(extract_prompt(text) + " Reply in JSON with the keys name and age."),
                                dict), TEXTS)
    assert valid == 20, failures


# ---------------------------------------------------------------------------------------------- instructor


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(oai, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(oai, mode=getattr(instructor.Mode, mode))

    def check(text):
        p = client.chat.completions.create(model=GEMMA, response_model=Person, max_tokens=56, temperature=0,
                                           max_retries=0, messages=[{"role": "user", "content": extract_prompt(text)}])
        return isinstance(p, Person)

    valid, failures = outcomes(check, TEXTS)
    assert valid == 20, failures


def test_instructor_iterable(oai):
    """response_model=Iterable[Contact] (instructor's TOOLS mode: one forced call of an `IterableContact` tool
    whose `tasks` list holds $ref'd items, required under the strict rule): every reply parses as a non-empty
    list of Contacts."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(oai, mode=instructor.Mode.TOOLS)
    sizes = []

    def check(i):
        text = f"Extract every person: {TEXTS[i]} {TEXTS[(i + 7) % 20]}"
        people = list(client.chat.completions.create(
            model=GEMMA, response_model=Iterable[Contact], max_tokens=48, temperature=0, max_retries=0,
            messages=[{"role": "user", "content": text}]))
        sizes.append(len(people))
        return (bool(people) and all(isinstance(p, Contact) for p in people)) or repr(people)

    valid, failures = outcomes(check, list(range(20)))
    print(f"Iterable[Contact]: {valid}/20 parsed, {sum(n > 0 for n in sizes)}/20 non-empty")
    assert valid == 20, failures


# ---------------------------------------------------------------------------------------------- openai SDK tools


def test_pydantic_function_tool_with_a_nested_model(oai):
    """openai.pydantic_function_tool(Person) (strict; City under $defs), forced: the arguments parse as Person."""
    tool = openai.pydantic_function_tool(Person)
    schema = tool["function"]["parameters"]

    def check(text):
        out = oai.chat.completions.parse(model=GEMMA, messages=[{"role": "user", "content": extract_prompt(text)}],
                                         tools=[tool], tool_choice={"type": "function", "function": {"name": "Person"}},
                                         max_tokens=48, temperature=0)
        (call,) = out.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema)
        return isinstance(call.function.parsed_arguments, Person)

    valid, failures = outcomes(check, TEXTS)
    assert valid == 20, failures


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}  # no additionalProperties, not strict: as most users write tools
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
QUESTIONS = ["What is the weather in Paris?", "Add 2 and 3.", "Is it raining in London?", "What is 17 plus 25?",
             "How warm is it in Rome in fahrenheit?", "Sum 100 and 250.", "Weather for Tokyo, please.",
             "What's 7 + 8?", "Tell me the weather in Cairo.", "Add 12 to 30.", "Is it cold in Oslo?",
             "What is 1 plus 1?", "Check the weather in Lima in celsius.", "Compute 40 + 2.",
             "What is the temperature in Madrid?", "Add 9 and 10.", "How is the weather in Berlin?",
             "What do 6 and 4 add up to?", "Weather in Sydney?", "Add 55 and 45."]


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tool_calls_have_no_keys_outside_the_schema(oai, tool_choice):
    """Every call, forced or under "auto", names a declared tool and its arguments validate against the tool's
    parameters closed (no invented keys); a forced choice always gives a call. One call per reply
    (parallel_tool_calls false): with parallel calls allowed the base Gemma writes the same call again on the
    next line until max_tokens (the reply is then cut, with no call returned)."""
    by_name = {t["function"]["name"]: closed(t["function"]["parameters"]) for t in (WEATHER, ADD)}
    calls = []

    def check(q):
        out = oai.chat.completions.create(model=GEMMA, messages=[{"role": "user", "content": q}], tools=[WEATHER, ADD],
                                          tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=48,
                                          temperature=0)
        choice = out.choices[0]
        tool_calls = choice.message.tool_calls or []
        if tool_choice == "required" and not (tool_calls and choice.finish_reason == "tool_calls"):
            return f"no call: {choice!r}"
        for c in tool_calls:
            jsonschema.validate(json.loads(c.function.arguments), by_name[c.function.name])
            calls.append(c.function.name)
        return True

    valid, failures = outcomes(check, QUESTIONS)
    print(f"tool_choice={tool_choice}: {valid}/20 replies valid, {len(calls)} calls")
    assert valid == 20, failures
    # Every question asks for one of the tools: under "auto" the model should mostly call (measured 20 of 20
    # after the fallback prompt opened with call skeletons; 0 before, docs/adapters.md).
    assert len(calls) >= 15, calls


# ---------------------------------------------------------------------------------------------- openai-agents


@pytest.mark.parametrize("tool_choice", ["required", None], ids=["required", "default"])
def test_openai_agents_default_model_runs_a_function_tool_agent(url, tool_choice):
    """The agent's model is a name, so openai-agents uses its default: OpenAIResponsesModel on the default
    client, which points at `prefixrt serve`. The turn calls the tool (tool_choice "required", or left to the
    model: openai-agents' default sends none, which is "auto"; one call per turn: see
    test_tool_calls_have_no_keys_outside_the_schema) and the run ends with the tool's result as the final
    output (tool_use_behavior "stop_on_first_tool"). Left to choose between another call and a final answer
    after the call, the base Gemma calls the tool again every turn until max_turns (docs/adapters.md)."""
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=url, api_key="test", max_retries=0),
                                     use_for_tracing=False)
    agent = agents.Agent(name="calculator", instructions="Use the add tool.", tools=[add], model=GEMMA,
                         tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice=tool_choice, parallel_tool_calls=False,
                                                             max_tokens=40, temperature=0))
    result = agents.Runner.run_sync(agent, "What is 2 + 3?", max_turns=3)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem"], kinds
    assert len(calls) == 1 and result.final_output == str(sum(calls[0]))  # the tool output, as text
    assert all(r.usage.input_tokens > 0 for r in result.raw_responses)
