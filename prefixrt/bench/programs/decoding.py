"""Decoding-shaped workloads.

json: facts about a city extracted from a document into JSON, one regex-constrained gen per field (REGEX_STR /
REGEX_FLOAT / REGEX_INT / a list of strings), so each field's call extends the previous one's prompt and the
constant JSON punctuation between fields is forced. multi_turn_short / multi_turn_long: chat sessions whose
every turn appends a question of 256-512 tokens' worth of words to the whole history, with short (4-8 token)
or long answers of a fixed length (ignore_eos), as the paper's multi-turn chat benchmark.
"""

from __future__ import annotations

from prefixrt.bench.programs.base import ProgramWorkload
from prefixrt.bench.programs.synthetic import SyntheticText
from prefixrt.frontend import REGEX_FLOAT, REGEX_INT, REGEX_STR, function, gen

REGEX_LIST = r"\[(" + REGEX_STR + ", )*" + REGEX_STR + r"\]"


@function
def json_decode(s, document: str):
    s += "Please extract the information of a city from the following wikipedia page.\n"
    s += "Page begin.\n" + document + "\nPage end.\n"
    s += "Here is the name, country, and symbol of the city in JSON format.\n"
    with s.var_scope("json_output"):
        s += "{\n"
        s += '  "name": ' + gen("name", max_tokens=8, regex=REGEX_STR + ",") + "\n"
        s += '  "country": ' + gen("country", max_tokens=8, regex=REGEX_STR + ",") + "\n"
        s += '  "latitude": ' + gen("latitude", max_tokens=8, regex=REGEX_FLOAT + ",") + "\n"
        s += '  "population": ' + gen("population", max_tokens=8, regex=REGEX_INT + ",") + "\n"
        s += '  "top 3 landmarks": ' + gen("landmarks", max_tokens=24, regex=REGEX_LIST) + "\n"
        s += "}\n"


def json_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    return [{"document": f"{t.name()} is a city in {t.name()}. " + t.passage(sizes["document_words"])}
            for _ in range(sizes["documents"])]


@function
def multi_turn_chat(s, turns: list):
    for question, answer_tokens in turns:
        s += "User: " + question + "\nAssistant:"
        s += gen(max_tokens=answer_tokens, ignore_eos=True) + "\n"


def multi_turn_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    lo, hi = sizes["answer_tokens"]
    return [{"turns": [(t.passage(t.rng.randint(*sizes["question_words"])), t.rng.randint(lo, hi))
                       for _ in range(sizes["turns"])]}
            for _ in range(sizes["sessions"])]


JSON = ProgramWorkload(
    name="json", title="JSON decoding (regex)",
    paper="JSON decoding with a regex: city facts extracted from a Wikipedia page, one constrained gen per field",
    sizes={"ci": dict(documents=3, document_words=40),
           "gpu": dict(documents=96, document_words=200)},
    make_args=json_args, program=json_decode,
)

MULTI_TURN_SHORT = ProgramWorkload(
    name="multi-turn-short", title="multi-turn chat, short outputs",
    paper="multi-turn chat: 4 turns, questions of 256-512 tokens, answers of 4-8 tokens",
    sizes={"ci": dict(sessions=3, turns=3, question_words=(20, 40), answer_tokens=(4, 8)),
           "gpu": dict(sessions=64, turns=4, question_words=(192, 384), answer_tokens=(4, 8))},
    make_args=multi_turn_args, program=multi_turn_chat, frontend_ablations=False,
)

MULTI_TURN_LONG = ProgramWorkload(
    name="multi-turn-long", title="multi-turn chat, long outputs",
    paper="multi-turn chat: 4 turns, questions of 256-512 tokens, answers of 256-512 tokens",
    sizes={"ci": dict(sessions=2, turns=2, question_words=(20, 40), answer_tokens=(16, 24)),
           "gpu": dict(sessions=32, turns=3, question_words=(192, 384), answer_tokens=(96, 128))},
    make_args=multi_turn_args, program=multi_turn_chat, frontend_ablations=False,
)
