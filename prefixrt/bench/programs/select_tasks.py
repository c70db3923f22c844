"""Multiple-choice workloads scored with `select` (choice logprobs: they run on dummy weights too).

mmlu: 5-shot, questions grouped by subject; a subject's questions share its five solved examples, the prefix
the cache reuses. hellaswag: 20-shot, one set of solved examples shared by every question; the choices are
whole sentence endings scored token by token.
"""

from __future__ import annotations

from prefixrt.bench.programs.base import ProgramWorkload
from prefixrt.bench.programs.synthetic import SyntheticText
from prefixrt.frontend import function, select

LETTERS = ("A", "B", "C", "D")


@function
def mmlu_question(s, shots: str, question: str):
    s += shots + question + "Answer:" + select("answer", [" A", " B", " C", " D"])


def _mmlu_item(t: SyntheticText, question_words: int, option_words: int, answer: str | None) -> str:
    lines = [t.sentence(question_words)[:-1] + "?"]
    lines += [f"{letter}. {t.words(option_words)}" for letter in LETTERS]
    return "\n".join(lines) + "\n" + (f"Answer: {answer}\n\n" if answer else "")


def mmlu_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    out = []
    for _ in range(sizes["subjects"]):
        subject = t.name().lower()
        head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
        shots = head + "".join(_mmlu_item(t, sizes["question_words"], sizes["option_words"], t.rng.choice(LETTERS))
                               for _ in range(sizes["shots"]))
        out += [{"shots": shots, "question": _mmlu_item(t, sizes["question_words"], sizes["option_words"], None)}
                for _ in range(sizes["questions_per_subject"])]
    t.rng.shuffle(out)  # subjects interleave, as a batch over the whole test set would
    return out


@function
def hellaswag_question(s, shots: str, context: str, endings: list):
    s += shots + context + select("answer", endings)


def hellaswag_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    shots = "".join(t.sentence(sizes["context_words"]) + " " + t.sentence(sizes["ending_words"]) + "\n\n"
                    for _ in range(sizes["shots"]))
    return [{"shots": shots, "context": t.sentence(sizes["context_words"]),
             "endings": [" " + t.sentence(sizes["ending_words"]) for _ in range(4)]}
            for _ in range(sizes["questions"])]


MMLU = ProgramWorkload(
    name="mmlu", title="5-shot MMLU (select)",
    paper="5-shot MMLU, select over A-D; questions of a subject share its 5 examples",
    sizes={"ci": dict(subjects=2, questions_per_subject=3, shots=5, question_words=20, option_words=4),
           "gpu": dict(subjects=4, questions_per_subject=32, shots=5, question_words=40, option_words=8)},
    make_args=mmlu_args, program=mmlu_question,
)

HELLASWAG = ProgramWorkload(
    name="hellaswag", title="20-shot HellaSwag (select)",
    paper="20-shot HellaSwag, select over 4 sentence endings; every question shares the 20 examples",
    sizes={"ci": dict(questions=6, shots=20, context_words=10, ending_words=6),
           "gpu": dict(questions=96, shots=20, context_words=20, ending_words=12)},
    make_args=hellaswag_args, program=hellaswag_question,
)
