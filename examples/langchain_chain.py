"""LangChain on prefixrt: prompt | model | parser, structured output, and tool calls.

Run: python examples/langchain_chain.py     (SmolLM2-135M-Instruct in-process; a couple of minutes on CPU)

Shows: a batch of prompts that share a system prompt (cached tokens per call), a pydantic schema enforced by
constrained decoding (with_structured_output), and a forced tool call (bind_tools + tool_choice).
"""

from __future__ import annotations

import argparse

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from pydantic import BaseModel, Field

from prefixrt import ChatPrefixRT


class Book(BaseModel):
    title: str = Field(description="the book's title")
    year: int = Field(description="year of publication")
    fiction: bool


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--base-url", default=None)
    args = ap.parse_args()

    def make(**kwargs) -> ChatPrefixRT:
        if args.base_url:
            return ChatPrefixRT(base_url=args.base_url, **kwargs)
        return ChatPrefixRT(model=args.model, **kwargs)  # one in-process engine, shared by every instance

    model = make(max_tokens=48)

    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are a helpful librarian. Answer in one short sentence."),
        ("human", "{question}"),
    ])
    questions = ["What is a library card?", "Why do libraries have quiet rooms?", "What is an e-book?"]
    raw = (prompt | model).batch([{"question": q} for q in questions])
    for q, m in zip(questions, raw):
        print(f"Q: {q}\n  A: {StrOutputParser().invoke(m)}\n"
              f"  tokens in {m.usage_metadata['input_tokens']}, cached "
              f"{m.usage_metadata['input_token_details']['cache_read']}")

    structured = prompt | make(max_tokens=64).with_structured_output(Book)
    print("\nstructured:", repr(structured.invoke({"question": "Name a famous novel."})))

    call = make(max_tokens=48).bind_tools([add], tool_choice="add").invoke("What is 17 plus 25?")
    print("tool call:", call.tool_calls[0]["name"], call.tool_calls[0]["args"])
    print("tool result:", add(**call.tool_calls[0]["args"]))


if __name__ == "__main__":
    main()
