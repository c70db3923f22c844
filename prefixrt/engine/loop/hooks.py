"""LoopHooks: everything EngineCore hands work to outside the loop, given whole to its constructor.

    deliver       one step's [(sink, StepOutput)] to their consumers: RequestStream.push_many in-process; the
                  engine process's pipe (engine/process/child.py) for `prefixrt serve`. Called by the
                  detokenizer worker when there is one, else by the loop.
    detokenizer   DetokenizerWorker (engine/detokenizer.py): text, stop strings and logprob strings off the
                  loop; it tells the loop which requests a stop string ended. None: outputs carry ids only.
    grammar       EngineGrammar (engine/grammar.py): the grammar backend the masks are filled from and the
                  bitmask ops; None: no constrained decoding.
    events        LoopEvents: observers of request events (engine/metrics.py's latency histograms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixrt.engine.stream import RequestStream


class LoopEvents:
    """Observers of the loop's request events, called on the loop thread (keep them cheap):
    fn("tokens", req=, num=, now=) when a step produces `num` tokens of req; fn("finished", req=, now=) when
    req finishes. Observers subscribe at any time (a server app may add metrics to a running engine)."""

    def __init__(self) -> None:
        self.observers: list[Callable[..., None]] = []

    def subscribe(self, fn: Callable[..., None]) -> None:
        self.observers.append(fn)

    def emit(self, event: str, **values: Any) -> None:
        for fn in self.observers:
            fn(event, **values)


@dataclass(frozen=True)
class LoopHooks:
    deliver: Callable[[list], None] = RequestStream.push_many
    detokenizer: Any = None  # engine/detokenizer.DetokenizerWorker, or None
    grammar: Any = None  # engine/grammar.EngineGrammar, or None
    events: LoopEvents = field(default_factory=LoopEvents)
