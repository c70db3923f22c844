"""Host time per streamed event of the serialization step, general path vs the fast paths (no sockets).

    PYTHONPATH=$PWD python benchmarks/sse_events.py

completions: sse(convert.completion_chunk(...)) (the general path) vs convert.TextEvents.event (the template);
chat: sse(convert.chat_chunk(..., {"content": t})) vs TextEvents; /generate: sse(dataclasses.asdict(chunk)) vs
sse(chunk.to_dict()). Each is checked to give the same string before it is timed. Median of 5 repeats.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import timeit

from benchmarks.common import script_parser
from prefixrt.outputs import Chunk
from prefixrt.server import openai_format as convert
from prefixrt.server.sse import sse

RID, MODEL, CREATED = "cmpl-0123456789abcdef0123456789abcdef", "llama-3-8b", 1764547200
TEXTS = [" the", " quick", " brown", " fox", "\u00e9t\u00e9", ",", " jumps", "\n"]


def per_event_us(fn, n: int = 20000) -> float:
    runs = timeit.repeat(fn, number=n, repeat=5)
    return statistics.median(runs) / n * 1e6


def main() -> None:
    script_parser(__doc__).parse_args()
    rows = []
    for obj in ("text_completion", "chat.completion.chunk"):
        ev = convert.TextEvents(RID, MODEL, CREATED, obj)
        if obj == "text_completion":
            def general(t=TEXTS):
                for x in t:
                    sse(convert.completion_chunk(RID, MODEL, CREATED, 0, x, None))
        else:
            def general(t=TEXTS):
                for x in t:
                    sse(convert.chat_chunk(RID, MODEL, CREATED, 0, {"content": x}, None))

        def fast(t=TEXTS, ev=ev):
            for x in t:
                ev.event(0, x, None)

        ref = convert.completion_chunk if obj == "text_completion" else None
        for x in TEXTS:
            want = sse(ref(RID, MODEL, CREATED, 0, x, None)) if ref else \
                sse(convert.chat_chunk(RID, MODEL, CREATED, 0, {"content": x}, None))
            assert ev.event(0, x, None) == want
        rows.append((obj, per_event_us(general) / len(TEXTS), per_event_us(fast) / len(TEXTS)))
    chunk = Chunk(request_id=RID, text="", token_ids=[1234], prompt_tokens=3580, cached_tokens=3500,
                  completion_tokens=17)
    assert json.dumps(chunk.to_dict()) == json.dumps(dataclasses.asdict(chunk))
    rows.append(("/generate chunk", per_event_us(lambda: sse(dataclasses.asdict(chunk))),
                 per_event_us(lambda: sse(chunk.to_dict()))))
    print(f"{'event':<24} {'general us':>11} {'fast us':>8}")
    for name, a, b in rows:
        print(f"{name:<24} {a:>11.2f} {b:>8.2f}")


if __name__ == "__main__":
    main()
