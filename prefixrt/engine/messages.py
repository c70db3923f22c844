"""The messages between a ProcessEngine (server process) and its engine process: the whole wire protocol.

Each is a small frozen dataclass, pickled over a multiprocessing Pipe (engine/process.py is the server end,
engine/process_child.py the engine end). Nothing else crosses the pipe.

    server -> engine   Add           a validated request (call_id set: reply once its grammar compiled)
                       Abort         a request id
                       Call          a blocking Engine method by name (stats, cache_prefix, generate, ...)
                       Shutdown
    engine -> server   Progress*, then Ready(EngineInfo) or Failed          start-up
                       Outputs       all outputs of one scheduler step, [(request id, StepOutput), ...]
                       Reply         the answer to an Add with a call_id, or to a Call
                       Beat          every HEARTBEAT_S, from its own thread
                       Bye           after Shutdown
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixrt.engine.stream import StepOutput
from prefixrt.params import SamplingParams

HEARTBEAT_S = 1.0  # how often the engine process says it is alive


# ---------------------------------------------------------------------------------------------- server -> engine
@dataclass(frozen=True, slots=True)
class Add:
    call_id: int | None  # None: fire and forget (fully validated in the server process)
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Call:
    call_id: int
    name: str
    args: tuple


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


# ---------------------------------------------------------------------------------------------- engine -> server
@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server process needs to front the engine (EngineFront's attributes)."""

    model_name: str
    model_revision: str
    vocab_size: int
    max_context: int
    kv_total_tokens: int
    page_size: int
    device: str
    tokenizer: bytes  # the pickled tokenizer: the server makes its own copies from it


@dataclass(frozen=True, slots=True)
class Progress:
    text: str


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


@dataclass(frozen=True, slots=True)
class Outputs:
    items: list[tuple[str, StepOutput]]


@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    ok: bool
    value: Any  # the result, or the exception when not ok


@dataclass(frozen=True, slots=True)
class Beat:
    pass


@dataclass(frozen=True, slots=True)
class Bye:
    pass


def picklable(e: BaseException) -> BaseException:
    """e itself if it survives pickling, else a RuntimeError carrying its type and message."""
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
