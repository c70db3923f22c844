"""The messages between a ProcessEngine (server process) and its engine process: the whole wire protocol.

Each is a small frozen dataclass, pickled over a multiprocessing Pipe (engine/process/client.py is the server end,
engine/process/child.py the engine end). Nothing else crosses the pipe.

    server -> engine   Add           a validated request (call_id set: reply once its grammar compiled); its
                                     prompt ids packed as int32 bytes (pack_token_ids)
                       Abort         a request id
                       Call          a blocking Engine method by name (stats, cache_prefix, generate, ...)
                       Shutdown
                       Batch         several of the above, each pickled on its own, sent as one message:
                                     what callers sent while the pipe was busy (group commit, pipe_writer.py)
    engine -> server   Progress*, then Ready(EngineInfo) or Failed          start-up
                       Outputs       all outputs of one scheduler step, [(request id, StepOutput), ...]
                       Reply         the answer to an Add with a call_id, or to a Call
                       Beat          every HEARTBEAT_S, from its own thread
                       Bye           after Shutdown
"""

from __future__ import annotations

import dataclasses
import pickle
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixrt.engine.stream import StepOutput
from prefixrt.params import SamplingParams

HEARTBEAT_S = 1.0  # how often the engine process says it is alive
_ID_TYPECODE = "i"  # C int: 32 bits on every platform prefixrt runs on; token ids are below the vocabulary size


def pack_token_ids(ids: list[int]) -> bytes:
    """Token ids as native int32 bytes: pickled as one memcpy instead of an opcode per id, and unpacked in C.
    Raises OverflowError for an id outside int32 (validated ids are within the vocabulary)."""
    return array(_ID_TYPECODE, ids).tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """The inverse of pack_token_ids: a new list of ints."""
    return array(_ID_TYPECODE, data).tolist()


class PackedIds(list):
    """A token-id prompt that carries its pack_token_ids bytes, made once where its elements are known to be ints
    (the server: pydantic's StrictInt lists). The engine API takes it without the per-id type scan, reads its id
    range off the bytes and sends those bytes as they are: one pass over a long prompt instead of up to six on
    the server's event loop. It is a list of its ids; never change one after it is made (`of` copies)."""

    __slots__ = ("packed",)

    @classmethod
    def of(cls, ids: list[int]) -> list[int]:
        """A PackedIds copy of ids; ids itself when they cannot be packed (an id beyond int32, a non-int), so that
        the engine's own checks name the problem."""
        try:
            packed = pack_token_ids(ids)
        except (OverflowError, TypeError):
            return ids
        out = cls(ids)
        out.packed = packed
        return out


def token_id_range(ids: list[int]) -> tuple[int, int]:
    """(smallest, largest) of token ids (at least one): read off a PackedIds' bytes, else two C-speed scans."""
    return packed_id_range(ids.packed) if type(ids) is PackedIds else (min(ids), max(ids))


def packed_id_range(data: bytes) -> tuple[int, int]:
    """(smallest, largest) of packed token ids (at least one), read off the buffer without unpacking it."""
    view = np.frombuffer(data, dtype=np.dtype(_ID_TYPECODE))
    return int(view.min()), int(view.max())


# ---------------------------------------------------------------------------------------------- server -> engine
@dataclass(frozen=True, slots=True)
class Add:
    call_id: int | None  # None: fire and forget (fully validated in the server process)
    request_id: str
    packed_prompt_ids: bytes  # pack_token_ids(prompt ids): a long prompt crosses the pipe as one buffer
    params: SamplingParams
    messages: list | None = None  # chat messages holding images (prepared in the engine process), else None

    @classmethod
    def of(cls, call_id: int | None, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Add:
        return cls(call_id, request_id, pack_token_ids(prompt_ids), params)

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (unpacked anew on each access)."""
        return unpack_token_ids(self.packed_prompt_ids)


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


@dataclass(frozen=True, slots=True)
class Batch:
    """Messages in the order they were sent, each pickled apart (one caller's message that cannot be
    unpickled fails alone): 64 requests arriving together cross the pipe as a few writes, not 64."""

    parts: list[bytes]


# ---------------------------------------------------------------------------------------------- engine -> server
@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server process needs to serve the engine's API (EngineAPI's attributes)."""

    model_name: str
    model_revision: str
    vocab_size: int
    max_context: int
    kv_total_tokens: int
    page_size: int
    device: str
    tokenizer: bytes  # the pickled tokenizer: the server makes its own copies from it
    model_path: str | None = None  # the local folder the model was loaded from

    @classmethod
    def of(cls, eng) -> EngineInfo:
        """The facts of a running Engine, its tokenizer pickled."""
        return cls(model_name=eng.model_name, model_revision=eng.model_revision, vocab_size=eng.vocab_size,
                   max_context=eng.max_context, kv_total_tokens=eng.kv_total_tokens, page_size=eng.page_size,
                   device=str(eng.device), tokenizer=pickle.dumps(eng.tokenizer),
                   model_path=getattr(eng, "model_path", None))

    def api_attributes(self) -> dict[str, Any]:
        """EngineAPI's attributes it carries (all but the tokenizer), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tokenizer"}


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
    steps: int = 0  # EngineCore.steps_done: a busy loop whose count stops is stuck (engine/progress.py)
    busy: bool = False  # EngineCore.has_work


@dataclass(frozen=True, slots=True)
class Bye:
    pass


def pickled(msg) -> bytes:
    """A message as the bytes that cross the pipe (multiprocessing's pickler, as Connection.send uses)."""
    from multiprocessing.reduction import ForkingPickler

    return bytes(ForkingPickler.dumps(msg))


def picklable(e: BaseException) -> BaseException:
    """e itself if it survives pickling, else a RuntimeError carrying its type and message."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
