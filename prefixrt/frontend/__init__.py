"""The frontend language: programs of gen/select/fork over chat roles, run on any Provider or an
OpenAI-compatible endpoint (with API speculative execution), interpreted or compiled.

ir.py           expressions (system/user/assistant, gen and typed gens, select, image/video)
interpreter.py  one background stream per program state; speculation buffer; fork/join operations
state.py        ProgramState (`s`): appending, role and var-scope blocks, reading, streaming; ForkGroup
program.py      @function, run (stream=True), run_batch (batch prefix hint, progress bar, generator)
compiler.py     trace -> Graph of primitives; CompiledProgram (prefix prefetch, gens submitted together)
chat_format.py  pieces -> prompt text (the model's chat template, or a plain layout)
backend.py      ProgramBackend interface, token usage; ProviderBackend (Engine, RemoteEngine)
token_prefix.py token continuity: the next prompt continues the exact ids of the last prompt and generation
select.py       choice scoring from token logprobs
openai_backend.py, speculative.py   OpenAIBackend and the speculative buffer
"""

from prefixrt.frontend.backend import Backend, BackendError, ProgramBackend, ProviderBackend, TokenUsage
from prefixrt.frontend.interpreter import ProgramError, RequestRecord, VariableNotFound
from prefixrt.frontend.ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    assistant,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    system,
    user,
    video,
)
from prefixrt.frontend.openai_backend import OpenAIBackend
from prefixrt.frontend.program import Program, function, set_default_backend
from prefixrt.frontend.state import ForkGroup, ProgramState

__all__ = [
    "function", "system", "user", "assistant", "gen", "gen_int", "gen_string", "select", "image", "video",
    "REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR", "OpenAIBackend", "ProviderBackend", "ProgramBackend", "Backend",
    "BackendError", "TokenUsage", "Program", "ProgramState", "ForkGroup", "ProgramError", "VariableNotFound",
    "RequestRecord", "set_default_backend",
]
