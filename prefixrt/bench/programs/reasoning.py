"""Branching workloads: forks that share the text before them.

tree_of_thought: a GSM8K-style word problem, then `levels` levels of `branches` branches; each child extends its
parent's output (a search tree of partial solutions). skeleton_of_thought: a skeleton of `points` points is
written first, then every point is expanded in its own fork and the expansions are joined. llm_judge
(branch-solve-merge): an article is judged along six dimensions in six forks, then one call merges the
judgements into a score.
"""

from __future__ import annotations

from prefixrt.bench.programs.base import ProgramWorkload
from prefixrt.bench.programs.synthetic import SyntheticText
from prefixrt.frontend import function, gen


@function
def tree_of_thought(s, question: str, levels: int, branches: int, node_tokens: int):
    s += ("Solve the math word problem step by step. Propose several ways to continue at each step.\n"
          f"Question: {question}\n")
    frontier = [s]
    for level in range(levels):
        children = []
        for node in frontier:
            for i, f in enumerate(node.fork(branches)):
                f += f"Step {level + 1}, idea {i + 1}:" + gen(f"step_{level}", max_tokens=node_tokens, stop="\n") + "\n"
                children.append(f)
        frontier = children
    for leaf in frontier:
        leaf.sync()


def tree_of_thought_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    return [{"question": f"{t.passage(sizes['question_words'])} How many {t.words(1)} are there in the end?",
             "levels": sizes["levels"], "branches": sizes["branches"], "node_tokens": sizes["node_tokens"]}
            for _ in range(sizes["trees"])]


@function
def skeleton_of_thought(s, question: str, points: int, skeleton_tokens: int, point_tokens: int):
    s += ("You are an organizer. Give only the skeleton of the answer (not the full content) as a numbered list "
          f"of {points} short points of 3-5 words each.\nQuestion: {question}\nSkeleton:\n")
    s += gen("skeleton", max_tokens=skeleton_tokens)
    s += "\nNow expand one point of the skeleton in 1-2 sentences.\n"
    forks = s.fork(points)
    for i, f in enumerate(forks):
        f += f"Point {i + 1}:" + gen("point", max_tokens=point_tokens, stop="\n\n")
    forks.join(mode="concate_and_append")


def skeleton_of_thought_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    return [{"question": t.sentence(sizes["question_words"])[:-1] + "?", "points": sizes["points"],
             "skeleton_tokens": sizes["skeleton_tokens"], "point_tokens": sizes["point_tokens"]}
            for _ in range(sizes["questions"])]


DIMENSIONS = ("Content", "Organization and Structure", "Argument and Analysis", "Clarity and Precision",
              "Grammar and Punctuation", "Referencing and Citation")


@function
def llm_judge(s, article: str, criteria: list, judgement_tokens: int):
    s += ("Please serve as an impartial judge and rigorously evaluate the quality of the following article.\n"
          f"```\n{article}\n```\n\n")
    forks = s.fork(len(criteria))
    for f, (dimension, criterion) in zip(forks, criteria):
        f += (f"USER: Please judge the quality based on the following metric. {dimension}: {criterion} Provide a "
              'single-paragraph judgement and end it with the word "END".\nJUDGE:')
        f += gen("judgement", max_tokens=judgement_tokens, stop="END")
    forks.join()
    s += "I will judge the quality based on the following metrics.\n"
    for f, (dimension, _) in zip(forks, criteria):
        s += f"{dimension}: {f['judgement'].strip()}\n"
    s += "In summary, on a scale of 1 to 10, I would give the article a score of" + gen("score", max_tokens=2)


def llm_judge_args(sizes: dict, seed: int) -> list[dict]:
    t = SyntheticText(seed)
    criteria = [(d, t.passage(sizes["criterion_words"])) for d in DIMENSIONS]
    return [{"article": t.passage(sizes["article_words"]), "criteria": criteria,
             "judgement_tokens": sizes["judgement_tokens"]} for _ in range(sizes["articles"])]


TREE_OF_THOUGHT = ProgramWorkload(
    name="tree-of-thought", title="tree-of-thought (GSM8K-style)",
    paper="tree-of-thought search on GSM8K questions: branches extend their parent's partial solution",
    sizes={"ci": dict(trees=2, levels=2, branches=2, node_tokens=8, question_words=30),
           "gpu": dict(trees=16, levels=3, branches=3, node_tokens=32, question_words=80)},
    make_args=tree_of_thought_args, program=tree_of_thought, uses_fork=True,
)

SKELETON_OF_THOUGHT = ProgramWorkload(
    name="skeleton-of-thought", title="skeleton-of-thought",
    paper="skeleton-of-thought: a skeleton first, then every point expanded in parallel and joined",
    sizes={"ci": dict(questions=2, points=3, question_words=20, skeleton_tokens=12, point_tokens=8),
           "gpu": dict(questions=64, points=5, question_words=40, skeleton_tokens=48, point_tokens=64)},
    make_args=skeleton_of_thought_args, program=skeleton_of_thought, uses_fork=True,
)

LLM_JUDGE = ProgramWorkload(
    name="llm-judge", title="LLM judge (branch-solve-merge)",
    paper="branch-solve-merge judge: an article judged along 6 dimensions in 6 forks, then merged into a score",
    sizes={"ci": dict(articles=2, article_words=60, criterion_words=12, judgement_tokens=8),
           "gpu": dict(articles=32, article_words=400, criterion_words=30, judgement_tokens=64)},
    make_args=llm_judge_args, program=llm_judge, uses_fork=True,
)
