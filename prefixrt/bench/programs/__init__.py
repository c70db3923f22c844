"""The SGLang paper's LM-program workloads (section 6) as frontend programs over synthetic text, their
ablations, and the runner that measures them (`prefixrt bench --program NAME`; docs/benchmarks-programs.md).

base.py          ProgramWorkload: a program, its argument builder, its sizes per preset (ci / gpu)
synthetic.py     seeded synthetic text
select_tasks.py  mmlu (5-shot), hellaswag (20-shot): select
agents.py        react, generative-agents: replayed agent traces
reasoning.py     tree-of-thought, skeleton-of-thought, llm-judge: forks
decoding.py      json (regex), multi-turn-short / multi-turn-long: chat sessions
dspy_rag.py      dspy-rag: a DSPy ChainOfThought RAG pipeline through prefixrt.LM
runner.py        ablations, request traces, run_workload, the results table
"""

from __future__ import annotations

from prefixrt.bench.programs.agents import GENERATIVE_AGENTS, REACT
from prefixrt.bench.programs.base import PRESETS, ProgramWorkload
from prefixrt.bench.programs.decoding import JSON, MULTI_TURN_LONG, MULTI_TURN_SHORT
from prefixrt.bench.programs.dspy_rag import DSPY_RAG
from prefixrt.bench.programs.reasoning import LLM_JUDGE, SKELETON_OF_THOUGHT, TREE_OF_THOUGHT
from prefixrt.bench.programs.select_tasks import HELLASWAG, MMLU

WORKLOADS: dict[str, ProgramWorkload] = {w.name: w for w in (
    MMLU, HELLASWAG, REACT, GENERATIVE_AGENTS, TREE_OF_THOUGHT, SKELETON_OF_THOUGHT, LLM_JUDGE, JSON,
    MULTI_TURN_SHORT, MULTI_TURN_LONG, DSPY_RAG)}

__all__ = ["WORKLOADS", "PRESETS", "ProgramWorkload"]
