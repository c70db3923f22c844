"""prefixrt: an LLM runtime that treats shared prefixes as first-class.

Public names are listed in __all__ and documented in docs/ and docs/api.md; everything else is internal.
"""

from __future__ import annotations

from prefixrt import source_tree as _source_tree

# From a source checkout, prefixrt.kernels / prefixrt.adapters live in the repo's top-level folders (see
# prefixrt/source_tree.py); an installed prefixrt has them in place and this does nothing.
_source_tree.install_finder(__file__)

from prefixrt.errors import InvalidRequest  # noqa: E402
from prefixrt.outputs import Chunk, Completion, EngineStats  # noqa: E402
from prefixrt.params import SamplingParams  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "Engine": ("prefixrt.engine.engine", "Engine"),
    "Provider": ("prefixrt.provider", "Provider"),
    "RemoteEngine": ("prefixrt.remote", "RemoteEngine"),
    "LM": ("prefixrt.adapters.dspy", "LM"),
    "ChatPrefixRT": ("prefixrt.adapters.langchain", "ChatPrefixRT"),
    "function": ("prefixrt.frontend", "function"),
    "system": ("prefixrt.frontend", "system"),
    "user": ("prefixrt.frontend", "user"),
    "assistant": ("prefixrt.frontend", "assistant"),
    "gen": ("prefixrt.frontend", "gen"),
    "select": ("prefixrt.frontend", "select"),
    "OpenAIBackend": ("prefixrt.frontend", "OpenAIBackend"),
    "gen_int": ("prefixrt.frontend", "gen_int"),
    "gen_string": ("prefixrt.frontend", "gen_string"),
    "image": ("prefixrt.frontend", "image"),
    "video": ("prefixrt.frontend", "video"),
    "set_default_backend": ("prefixrt.frontend", "set_default_backend"),
    "REGEX_INT": ("prefixrt.frontend", "REGEX_INT"),
    "REGEX_FLOAT": ("prefixrt.frontend", "REGEX_FLOAT"),
    "REGEX_BOOL": ("prefixrt.frontend", "REGEX_BOOL"),
    "REGEX_STR": ("prefixrt.frontend", "REGEX_STR"),
    "RuntimeEndpoint": ("prefixrt.remote", "RemoteEngine"),  # the name SGLang programs use for a server
}

__all__ = ["InvalidRequest", "Chunk", "Completion", "EngineStats", "SamplingParams", *_LAZY]


def __getattr__(name: str):
    # Heavy modules (torch models, dspy, langchain) load only when their name is first used.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'prefixrt' has no attribute {name!r}")
