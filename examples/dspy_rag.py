"""DSPy RAG on prefixrt: ChainOfThought with demos over a small local corpus and a keyword-overlap retriever.

Run: python examples/dspy_rag.py            (SmolLM2-135M-Instruct in-process; a few minutes on CPU)
     python examples/dspy_rag.py --base-url http://127.0.0.1:30000   (a running `prefixrt serve`)

Shows: the questions are answered concurrently with module.batch; DSPy's instructions and the demos form a
prompt prefix every call shares, which the engine prefills once — see the cached tokens per call.
JSONAdapter's output schema is enforced by constrained decoding, so every answer parses.
"""

from __future__ import annotations

import argparse
import re

import dspy

import prefixrt

CORPUS = [
    "The city library opens at 9 am and closes at 8 pm on weekdays.",
    "On Saturdays the library opens at 10 am and closes at 4 pm; it is closed on Sundays.",
    "Books can be borrowed for three weeks and renewed twice online.",
    "Late returns cost 20 cents per book per day, up to 5 dollars.",
    "The reading room on the second floor is a quiet zone.",
    "Library cards are free for residents and cost 30 dollars a year for visitors.",
    "The children's section hosts story time every Wednesday at 4 pm.",
    "Printing costs 10 cents per page in black and white.",
]


def retrieve(question: str, k: int = 2) -> list[str]:
    """The k passages sharing the most words with the question."""
    words = set(re.findall(r"\w+", question.lower()))
    scored = sorted(CORPUS, key=lambda p: -len(words & set(re.findall(r"\w+", p.lower()))))
    return scored[:k]


class RAG(dspy.Module):
    def __init__(self):
        self.answer = dspy.ChainOfThought("context: list[str], question -> answer")

    def forward(self, question: str):
        return self.answer(context=retrieve(question), question=question)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--base-url", default=None)
    args = ap.parse_args()
    lm = prefixrt.LM(base_url=args.base_url) if args.base_url else prefixrt.LM(args.model, max_tokens=160)
    dspy.configure(lm=lm, adapter=dspy.JSONAdapter(), track_usage=True)
    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)

    rag = RAG()
    rag.answer.predict.demos = [
        dspy.Example(context=["The museum opens at 10 am."], question="When does the museum open?",
                     reasoning="The context says the museum opens at 10 am.", answer="10 am"),
        dspy.Example(context=["Parking costs 2 dollars an hour."], question="How much is parking?",
                     reasoning="Parking is 2 dollars per hour.", answer="2 dollars an hour"),
    ]
    questions = ["When does the library open on weekdays?", "How long can I borrow a book?",
                 "How much is a late return?", "Is the library open on Sunday?"]
    print(f"model: {lm.model}")
    results = rag.batch([dspy.Example(question=q).with_inputs("question") for q in questions])
    for q, r in zip(questions, results):
        usage = r.get_lm_usage()[lm.model]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        print(f"\nQ: {q}\n  reasoning: {r.reasoning}\n  answer: {r.answer}\n"
              f"  prompt tokens {usage['prompt_tokens']}, cached {cached}")


if __name__ == "__main__":
    main()
