"""Three-field extraction on an OpenAI-compatible endpoint, with and without API speculative execution.

    python examples/openai_extraction.py                                   # SmolLM2-135M-Instruct in-process (CPU)
    python examples/openai_extraction.py --base-url http://127.0.0.1:30000/v1 --model smollm2-135m-instruct

In-process, the `openai` client is prefixrt.openai's (same app as `prefixrt serve`, without sockets).
Counts are the endpoint's own usage reports (against `prefixrt serve`, its /stats agree).

With speculation, the three gens are answered by one call (max_tokens = --speculative-tokens) split against
the template; a continuation that does not follow the template falls back to ordinary calls.
"""

from __future__ import annotations

import argparse
import time

import openai

import prefixrt
from prefixrt import assistant, function, gen, user

SHOT = ("Text: Marie Curie was a physicist and chemist who worked in Paris.\n"
        "Name: Marie Curie\nJob: physicist\nCity: Paris\n\n")
DOC = "Kenji Tanaka runs a small ramen shop in Osaka, where he has cooked noodles for twenty years."


@function
def extract(s, doc):
    s += SHOT + "Text: " + doc + "\n"
    s += "Name:" + gen("name", max_tokens=16, stop="\n") + "\nJob:" + gen("job", max_tokens=16, stop="\n") \
        + "\nCity:" + gen("city", max_tokens=16, stop="\n")


@function
def extract_chat(s, doc):
    s += user("Extract the person's name, job and city, one per line as in this example.\n" + SHOT + doc)
    s += assistant("Name:" + gen("name", max_tokens=16, stop="\n") + "\nJob:" + gen("job", max_tokens=16, stop="\n")
                   + "\nCity:" + gen("city", max_tokens=16, stop="\n"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--base-url")
    ap.add_argument("--chat", action="store_true", help="use /chat/completions (default: /completions); the "
                    "non-speculative run needs an endpoint that continues a partial assistant message")
    ap.add_argument("--speculative-tokens", type=int, default=24)
    args = ap.parse_args()
    if args.base_url:
        client = openai.OpenAI(base_url=args.base_url, api_key="EMPTY")
    else:
        from prefixrt.openai import OpenAI

        client = OpenAI(model=args.model)
    program = extract_chat if args.chat else extract
    for spec in (0, args.speculative_tokens):
        backend = prefixrt.OpenAIBackend(args.model, client=client, speculative_tokens=spec, chat=args.chat)
        t0 = time.perf_counter()
        st = program.run(doc=DOC, backend=backend, temperature=0)
        fields = {k: st[k].strip() for k in ("name", "job", "city")}
        print(f"speculative_tokens={spec:>3}: {fields}  api_calls={backend.num_api_calls} "
              f"prompt_tokens={backend.prompt_tokens} time={time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
