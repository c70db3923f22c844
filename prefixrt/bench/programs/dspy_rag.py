"""DSPy RAG pipeline: dspy.ChainOfThought with solved demos over a small local corpus and a keyword-overlap
retriever, driven through prefixrt.LM (JSONAdapter: the reply schema is enforced by constrained decoding, so
every reply parses, on dummy weights too). Questions run concurrently with `module.batch`; DSPy's instructions and
the demos form the prefix every call shares. Not a frontend program: the frontend's hint and parallelism
ablations do not apply (DSPy issues one call per question)."""

from __future__ import annotations

import re
import time

from prefixrt.bench.programs.base import ProgramWorkload
from prefixrt.bench.programs.synthetic import SyntheticText


def rag_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    corpus = [t.passage(sizes["passage_words"]) for _ in range(sizes["corpus"])]
    demos = [{"question": t.sentence(10)[:-1] + "?", "context": [t.passage(sizes["passage_words"])],
              "reasoning": t.sentence(16), "answer": t.words(3)} for _ in range(sizes["demos"])]
    questions = []
    for _ in range(sizes["questions"]):
        anchor = t.rng.choice(corpus).split()  # a question that shares words with one passage
        questions.append(" ".join(t.rng.sample(anchor, min(6, len(anchor)))) + " " + t.words(4) + "?")
    return [{"question": q, "corpus": corpus, "demos": demos, "k": sizes["k"]} for q in questions]


def retrieve(corpus: list[str], question: str, k: int) -> list[str]:
    """The k passages sharing the most words with the question (ties: corpus order)."""
    words = set(re.findall(r"\w+", question.lower()))
    return sorted(corpus, key=lambda p: -len(words & set(re.findall(r"\w+", p.lower()))))[:k]


def run_rag(provider, args: list[dict], sizes: dict, num_threads: int, latencies: list[float]) -> list:
    """Answer every question with one ChainOfThought call each, num_threads at a time (each call's seconds
    appended to latencies); returns the predictions. Raises if any question failed."""
    from concurrent.futures import ThreadPoolExecutor

    import dspy

    from prefixrt.adapters.dspy import LM

    lm = LM(engine=provider, max_tokens=sizes["max_tokens"], cache=False, num_retries=0)
    module = dspy.ChainOfThought("context: list[str], question -> answer")
    module.predict.demos = [dspy.Example(**d) for d in args[0]["demos"]]
    adapter = dspy.JSONAdapter()

    def one(a: dict):
        t0 = time.perf_counter()
        with dspy.context(lm=lm, adapter=adapter):
            pred = module(context=retrieve(a["corpus"], a["question"], a["k"]), question=a["question"])
        latencies.append(time.perf_counter() - t0)
        return pred

    with ThreadPoolExecutor(max_workers=max(1, min(num_threads, len(args)))) as pool:
        return list(pool.map(one, args))


DSPY_RAG = ProgramWorkload(
    name="dspy-rag", title="DSPy RAG pipeline",
    paper="DSPy RAG pipeline: ChainOfThought with demos over retrieved passages",
    sizes={"ci": dict(questions=3, corpus=6, passage_words=20, demos=2, k=2, max_tokens=48),
           "gpu": dict(questions=96, corpus=64, passage_words=80, demos=4, k=3, max_tokens=96)},
    make_args=rag_args, run=run_rag, frontend_ablations=False,
)
