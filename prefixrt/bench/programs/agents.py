"""Agent workloads that replay a recorded trace, as the paper's do (the model's thoughts are generated, the
tools' observations come from the trace).

react: a ReAct agent over a long few-shot prompt shared by every agent; each step generates "Thought i: ... Action
i: ..." (up to the next "Observation"), then appends the trace's observation, so step i+1 extends step i.
generative_agents: agents of a simulated town; each agent's calls (rate an event, summarise it, pick a place)
restart from its persona description, so the calls of one agent share that prefix, not each other's text.
"""

from __future__ import annotations

from prefixrt.bench.programs.base import ProgramWorkload
from prefixrt.bench.programs.synthetic import SyntheticText
from prefixrt.frontend import function, gen


@function
def react_agent(s, examples: str, question: str, steps: list, thought_tokens: int):
    s += examples + "Question: " + question + "\n"
    for i, step in enumerate(steps, 1):
        s += f"Thought {i}:" + gen(f"thought_{i}", max_tokens=thought_tokens, stop="Observation")
        s += f"Observation {i}: {step}\n"
    s += f"Thought {len(steps) + 1}:" + gen("final", max_tokens=thought_tokens, stop="Observation")


def react_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    head = ("Solve a question answering task with interleaving Thought, Action, Observation steps. Action can be "
            "Search[entity], Lookup[keyword] or Finish[answer].\nHere are some examples.\n")
    examples = head + "".join(
        f"Question: {t.sentence(16)[:-1]}?\n" + "".join(
            f"Thought {i}: {t.sentence(18)}\nAction {i}: Search[{t.name()}]\nObservation {i}: "
            f"{t.passage(sizes['observation_words'])}\n" for i in range(1, 5)) + "\n"
        for _ in range(sizes["examples"]))
    return [{"examples": examples, "question": t.sentence(16)[:-1] + "?", "thought_tokens": sizes["thought_tokens"],
             "steps": [t.passage(sizes["observation_words"]) for _ in range(sizes["steps"])]}
            for _ in range(sizes["agents"])]


CALLS = (
    ("On the scale of 1 to 10, where 1 is purely mundane and 10 is extremely poignant, rate the likely "
     "poignancy of the following event for {name}.\nEvent: {event}\nRate (return a number between 1 to 10):", 4),
    ("Task: turn the input into (subject, predicate, object).\nInput: {name} is {event}\nOutput: (", 24),
    ("Convert an action description to an emoji (important: use two or less emojis).\nAction description: "
     "{event}\nEmoji:", 6),
    ("{name} is {event}. For {name}, which area of the town should they go to? Answer in one area name.\nArea:", 12),
    ("{name} is {event}. Which object in that area should {name} use? Answer in one object name.\nObject:", 12),
)


@function
def generative_agent(s, persona: str, name: str, events: list):
    s += persona
    for event in events:
        for template, max_tokens in CALLS:  # each call restarts from the persona (one fork: no hint)
            call = s.fork(1)[0]
            call += "\n" + template.format(name=name, event=event) + gen("out", max_tokens=max_tokens, stop="\n")
            call.sync()


def generative_agents_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    out = []
    for _ in range(sizes["agents"]):
        name = t.name()
        persona = (f"Name: {name}\nAge: {t.number(20, 70)}\nInnate traits: {t.words(3)}\nLearned traits: "
                   f"{t.passage(sizes['persona_words'])}\nCurrently: {t.sentence(20)}\nLifestyle: {t.sentence(20)}\n")
        out.append({"persona": persona, "name": name,
                    "events": [t.words(sizes["event_words"]) for _ in range(sizes["events"])]})
    return out


REACT = ProgramWorkload(
    name="react", title="ReAct agents",
    paper="ReAct agents replaying HotpotQA traces: a long shared few-shot prompt, each step extends the last",
    sizes={"ci": dict(agents=2, steps=2, examples=1, observation_words=16, thought_tokens=8),
           "gpu": dict(agents=32, steps=4, examples=3, observation_words=60, thought_tokens=48)},
    make_args=react_args, program=react_agent,
)

GENERATIVE_AGENTS = ProgramWorkload(
    name="generative-agents", title="generative agents",
    paper="generative agents replaying a town simulation's calls: short calls restarting from each persona",
    sizes={"ci": dict(agents=2, events=1, persona_words=40, event_words=8),
           "gpu": dict(agents=48, events=2, persona_words=300, event_words=12)},
    make_args=generative_agents_args, program=generative_agent, uses_fork=True,
)
