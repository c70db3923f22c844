"""Nineteen program shapes of SGLang's frontend test suite, written the way SGLang users write programs (one
namespace alias, `@function`, `s += ...`, no backend argument: the default backend), in this project's own
words. tests/frontend/test_sglang_programs.py runs them on Engine, RemoteEngine and Gemma-3-270M.
"""

from __future__ import annotations

import ast
import operator

import prefixrt as pr


# ---------------------------------------------------------------------- 1. few-shot QA
@pr.function
def few_shot_capitals(s, question):
    s += "Each question below names a country; the answer is its capital.\n\n"
    s += "Q: What is the capital of Spain?\n"
    s += "A: Madrid\n"
    s += "Q: What is the capital of Egypt?\n"
    s += "A: Cairo\n"
    s += "Q: What is the capital of Peru?\n"
    s += "A: Lima\n"
    s += "Q: " + question + "\n"
    s += "A:" + pr.gen("answer", stop="\n", temperature=0)


# ---------------------------------------------------------------------- 2. multi-turn bench with role blocks
@pr.function
def two_turn_chat(s, first, second):
    s += pr.system("You answer briefly.")
    s += pr.user(first)
    s += pr.assistant(pr.gen("answer_1"))
    with s.user():
        s += second
    with s.assistant():
        s += pr.gen("answer_2")


# ---------------------------------------------------------------------- 3. select
@pr.function
def judge_statement(s, statement):
    s += "Label each statement as True, False or Unknown.\n"
    s += "Statement: Water boils at 100 degrees Celsius at sea level.\n"
    s += "Label: True\n"
    s += "Statement: " + statement + "\n"
    s += "Label:" + pr.select("label", ["True", "False", "Unknown"])


# ---------------------------------------------------------------------- 4. decode int
@pr.function
def count_facts(s):
    s += "A week has this many days: " + pr.gen_int("days") + "\n"
    s += "A minute has this many seconds: " + pr.gen_int("seconds") + "\n"


# ---------------------------------------------------------------------- 5. JSON by regex inside a var scope
@pr.function
def city_json_regex(s):
    s += "Describe the city of Lyon as a JSON object.\n"
    with s.var_scope("record"):
        s += "{\n"
        s += '  "name": ' + pr.gen(regex=pr.REGEX_STR) + ",\n"
        s += '  "inhabitants": ' + pr.gen(regex=pr.REGEX_INT, stop=[" ", "\n"]) + ",\n"
        s += '  "elevation": ' + pr.gen(regex=pr.REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
        s += "}"


# ---------------------------------------------------------------------- 6. JSON by typed gens
@pr.function
def city_json_typed(s):
    s += "Describe the city of Lyon as a JSON object.\n"
    with s.var_scope("record"):
        s += "{\n"
        s += '  "name": ' + pr.gen_string() + ",\n"
        s += '  "inhabitants": ' + pr.gen_int() + ",\n"
        s += '  "districts": ' + pr.gen(dtype=int) + ",\n"
        s += '  "river": ' + pr.gen(dtype=str) + "\n"
        s += "}"


# ---------------------------------------------------------------------- 7. expert answer (a value re-used)
@pr.function
def ask_an_expert(s, question):
    s += "Question: " + question + "\n"
    s += "Someone who knows the answer well is" + pr.gen("expert", stop=[".", "\n"]) + ".\n"
    s += "Asked this," + s["expert"] + " would say that " + pr.gen("answer", stop=".") + "."


# ---------------------------------------------------------------------- 8. tool use
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Integer arithmetic (+, -, *) on literals; anything else is reported, not evaluated."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError
    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "not computable"


@pr.function
def multiply_with_tool(s, a, b):
    s += "Use the calculator as calc(expression) to compute results.\n"
    s += "Example: calc(2+5) = 7\nExample: calc(6*7) = 42\n"
    s += "Question: what is " + str(a) + " times " + str(b) + "?\n"
    s += "Answer: calc(" + pr.gen("expression", stop=")") + ") = "
    with s.var_scope("result"):
        s += calculator(s["expression"])


# ---------------------------------------------------------------------- 9. ReAct (branching on a select)
@pr.function
def react_agent(s, question, max_steps=3):
    s += "Question: Which river flows through the capital of Austria?\n"
    s += "Thought 1: I should look up the capital of Austria.\n"
    s += "Action 1: Search [capital of Austria].\n"
    s += "Observation 1: The capital of Austria is Vienna.\n"
    s += "Thought 2: The Danube flows through Vienna.\n"
    s += "Action 2: Finish [Danube].\n\n"
    s += "Question: " + question + "\n"
    for i in range(1, max_steps + 1):
        s += f"Thought {i}:" + pr.gen(stop=[".", "\n"]) + ".\n"
        s += f"Action {i}: " + pr.select(f"action_{i}", ["Search", "Finish"])
        if s[f"action_{i}"] == "Search":
            s += " [" + pr.gen(stop="]") + "].\n"
            s += f"Observation {i}:" + pr.gen(stop=[".", "\n"]) + ".\n"
        else:
            s += " [" + pr.gen("answer", stop="]") + "].\n"
            break


# ---------------------------------------------------------------------- 10. parallel decoding (skeleton)
TIPS = 3


@pr.function
def tips_skeleton(s, topic):
    s += "You are a helpful assistant.\n"
    s += "USER: Share advice on " + topic + ".\n"
    s += f"ASSISTANT: Here are {TIPS} short tips:\n"
    for i in range(1, TIPS + 1):
        s += f"{i}." + pr.gen(max_tokens=6, stop=[".", "\n"]) + ".\n"
    forks = s.fork(TIPS)
    for i in range(TIPS):
        forks[i] += f"Expanding tip {i + 1} into a paragraph:\nTip {i + 1}:"
        forks[i] += pr.gen("detail", 8, stop=["\n\n"])
    forks.join()
    s += "The tips in detail:\n"
    for i in range(TIPS):
        s += f"Tip {i + 1}:" + forks[i]["detail"] + "\n"
    s += "\nTo sum up," + pr.gen("summary", max_tokens=8)


# ---------------------------------------------------------------------- 11. parallel encoding
@pr.function
def answer_from_facts(s, question, fact_0, fact_1, fact_2):
    s += "USER: I will give you some facts, then ask a question.\n"
    s += "ASSISTANT: Go ahead.\n"
    s += "USER: Remember these facts.\n"
    facts = [fact_0, fact_1, fact_2]
    forks = s.fork(len(facts))
    forks += lambda i: f"Fact {i}: " + facts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Now answer the question in one sentence."
    s += "\nQuestion: " + question + "\n"
    s += "ASSISTANT:" + pr.gen("answer", max_tokens=8)


# ---------------------------------------------------------------------- 12. image QA
@pr.function
def describe_image(s, path, question):
    s += pr.user(pr.image(path) + question)
    s += pr.assistant(pr.gen("answer"))


# ---------------------------------------------------------------------- 13. streaming
@pr.function
def chat_qa(s, question):
    s += pr.system("You are a helpful assistant.")
    s += pr.user(question)
    s += pr.assistant(pr.gen("answer"))


# ---------------------------------------------------------------------- 14. regex
IPV4 = r"((25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"


@pr.function
def dns_address(s):
    s += "Q: Which IPv4 address does a well-known public DNS resolver use?\n"
    s += "A: " + pr.gen("address", temperature=0, regex=IPV4)


# ---------------------------------------------------------------------- 15. dtype gens
@pr.function
def typed_answers(s):
    s += "Q: What does the abbreviation CPU stand for?\n"
    s += "A: It stands for " + pr.gen("text", dtype=str, stop="\n") + "\n"
    s += "Q: In which year did the first moon landing happen?\n"
    s += "A: " + pr.gen("year", dtype=int) + "\n"
    s += "Q: What is the square root of two?\n"
    s += "A: " + pr.gen("root", dtype=float) + "\n"
    s += "Q: Is ice colder than steam?\n"
    s += "A: " + pr.gen("colder", dtype=bool) + "\n"


# ---------------------------------------------------------------------- 16./17. API speculative execution
CHARACTER_INTRO = "Invent a character in this format:\nName: Ada Lovelace.\nBorn: December 10, 1815.\n" \
                  "Work: Mathematician.\n\nNow invent another one.\n"


@pr.function(num_api_spec_tokens=64)
def character_spec(s):
    s += CHARACTER_INTRO
    s += "Name:" + pr.gen("name", stop="\n") + "\nBorn:" + pr.gen("born", stop="\n")
    s += "\nWork:" + pr.gen("work", stop="\n") + "\n"


@pr.function
def character_plain(s):
    s += CHARACTER_INTRO
    s += "Name:" + pr.gen("name", stop="\n") + "\nBorn:" + pr.gen("born", stop="\n")
    s += "\nWork:" + pr.gen("work", stop="\n") + "\n"


@pr.function(num_api_spec_tokens=128)
def character_chat_spec(s):
    s += pr.system("You are a helpful assistant.")
    s += pr.user("Invent a character in this format:")
    s += pr.assistant("Name: Ada Lovelace.\nBorn: December 10, 1815.\nWork: Mathematician.\n")
    s += pr.user("Now invent another one.\n")
    s += pr.assistant("Name:" + pr.gen("name", stop="\n") + "\nBorn:" + pr.gen("born", stop="\n")
                      + "\nWork:" + pr.gen("work", stop="\n"))


# ---------------------------------------------------------------------- 18. HellaSwag-style select in a batch
@pr.function
def pick_ending(s, context, endings):
    s += SHOTS + context
    s += pr.select("ending", choices=endings)


SHOTS = ("Baking: She mixes flour and eggs in a bowl. She pours the batter into a pan and bakes it.\n\n"
         "Cycling: A man adjusts his helmet. He rides down the hill on his bike.\n\n")
ENDING_ITEMS = [
    ("Gardening: A woman kneels by a flower bed. She", [" plants tulip bulbs in the soil.", " flies a kite.",
                                                         " reads the newspaper aloud.", " paints the sky."]),
    ("Swimming: A boy stands at the edge of the pool. He", [" dives into the water.", " eats a sandwich.",
                                                             " types on a laptop.", " climbs a tree."]),
    ("Cooking: A chef slices onions on a board. He", [" adds them to a hot pan.", " sings to the onions.",
                                                       " drives a car.", " closes the window."]),
    ("Music: A girl sits at the piano. She", [" plays a slow melody.", " mows the lawn.", " boards a train.",
                                               " washes the dishes."]),
]


# ---------------------------------------------------------------------- 19. min tokens
MIN_TOKENS, MAX_TOKENS = 12, 16


@pr.function
def long_enough(s):
    s += pr.user("Name the largest planet.")
    s += pr.assistant(pr.gen("answer", min_tokens=MIN_TOKENS, max_tokens=MAX_TOKENS))
