"""The frontend language: programs of gen/select/fork over chat roles, run on any Provider or an
OpenAI-compatible endpoint (with API speculative execution).

ir.py           expressions (system/user/assistant, gen, select)
interpreter.py  program states, one background stream each; fork/join; errors
program.py      @function, run, run_batch (batch prefix hint)
chat_format.py  pieces -> prompt text (the model's chat template, or a plain layout)
backend.py      ProgramBackend interface (where programs run); ProviderBackend (Engine, RemoteEngine)
select.py       choice scoring from token logprobs
openai_backend.py, speculative.py   OpenAIBackend and speculative template matching
"""

from prefixrt.frontend.backend import Backend, BackendError, ProgramBackend, ProviderBackend
from prefixrt.frontend.interpreter import (
    ForkGroup,
    ProgramError,
    ProgramState,
    RequestRecord,
    VariableNotFound,
)
from prefixrt.frontend.ir import assistant, gen, select, system, user
from prefixrt.frontend.openai_backend import OpenAIBackend
from prefixrt.frontend.program import Program, function, set_default_backend

__all__ = [
    "function", "system", "user", "assistant", "gen", "select", "OpenAIBackend", "ProviderBackend", "ProgramBackend", "Backend",
    "BackendError", "Program", "ProgramState", "ForkGroup", "ProgramError", "VariableNotFound", "RequestRecord",
    "set_default_backend",
]
