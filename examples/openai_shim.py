"""The OpenAI client, unchanged, on an in-process prefixrt engine (no server, no sockets).

Run: python examples/openai_shim.py          (SmolLM2-135M-Instruct in-process)

Shows: chat completions, streaming, cached_tokens in usage on a repeated prefix, and a JSON-schema
response_format enforced by constrained decoding.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    try:
        from prefixrt.openai import OpenAI
    except ImportError:
        sys.exit("prefixrt.openai (the OpenAI client shim) is not in this installation yet; "
                 "see docs/adapters.md, or run `prefixrt serve` and point openai.OpenAI(base_url=...) at it.")
    client = OpenAI(model="smollm2-135m-instruct")
    system = {"role": "system", "content": "You are a helpful librarian. Answer in one short sentence."}
    for question in ["What is a library card?", "What is an e-book?"]:
        r = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=40,
                                           messages=[system, {"role": "user", "content": question}])
        cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
        print(f"Q: {question}\n  A: {r.choices[0].message.content}\n"
              f"  prompt tokens {r.usage.prompt_tokens}, cached {cached}")
    print("streaming: ", end="")
    stream = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=40, stream=True,
                                            messages=[system, {"role": "user", "content": "Say hello."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    schema = {"type": "object", "additionalProperties": False, "required": ["title", "year"],
              "properties": {"title": {"type": "string", "maxLength": 40},
                             "year": {"type": "integer", "minimum": 1450, "maximum": 2030}}}
    r = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=40,
        messages=[{"role": "user", "content": "Name a famous novel and the year it was published, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "novel", "schema": schema}})
    print("structured:", json.loads(r.choices[0].message.content))


if __name__ == "__main__":
    main()
