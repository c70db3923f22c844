"""Where the DSPy and LangChain adapters' Provider comes from: one in-process Engine per model and engine options
for the whole process, or a RemoteEngine over `prefixrt serve`, built on first use (ProviderHandle).

The adapters lower their requests with prefixrt/lowering/ (as `prefixrt serve` does). Nothing here imports DSPy
or LangChain. Everything speaks the Provider protocol (prefixrt/provider.py), so an in-process Engine and a
RemoteEngine over `prefixrt serve` are interchangeable.
"""

from __future__ import annotations

import threading
from typing import Any

_shared_engines: dict[tuple, Any] = {}
_shared_lock = threading.Lock()


def shared_engine(model: str, engine_kwargs: dict | None = None):
    """One in-process Engine per (model, engine kwargs) for the whole process.

    Loading weights is the expensive part, and several adapter objects (a DSPy LM, its copies, a LangChain
    model, a reloaded program) naming the same model should share one radix cache, which is what makes their
    shared prefixes hit. The engine lives until the process exits.
    """
    kwargs = dict(engine_kwargs or {})
    key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    with _shared_lock:
        eng = _shared_engines.get(key)
        if eng is None:
            from prefixrt.engine.engine import Engine

            eng = Engine(model, **kwargs)
            _shared_engines[key] = eng
        return eng


def remote_engine(base_url: str, api_key: str | None = None):
    """A RemoteEngine (Provider over a `prefixrt serve` server); an actionable error while it is missing."""
    try:
        from prefixrt.remote import RemoteEngine
    except ImportError as e:
        raise ImportError(
            "base_url= needs prefixrt.RemoteEngine (prefixrt/remote.py), which this installation does not have; "
            "pass model= or engine= to run in-process"
        ) from e
    return RemoteEngine(base_url, api_key=api_key)


class ProviderHandle:
    """Where an adapter's Provider comes from, built on first use and shared by copies of the adapter.

    Exactly one source: `provider` (an Engine, RemoteEngine or any Provider), `model` (a registry name or a
    local HF folder, loaded in-process once per process), or `base_url` (a `prefixrt serve` server).
    `model` together with `base_url` names the server's model without asking it; `model` together with `provider`
    or `base_url` may name one of its LoRA adapters, which every request then runs under (`lora`).
    """

    def __init__(self, *, model: str | None = None, provider: Any = None, base_url: str | None = None,
                 api_key: str | None = None, engine_kwargs: dict | None = None):
        if provider is not None and base_url is not None:
            raise ValueError("pass engine= alone (with model= naming one of its LoRA adapters), or model= / "
                             "base_url=, not both")
        if provider is None and model is None and base_url is None:
            raise ValueError("pass model= (a registry name or local folder), engine= or base_url=")
        self.model = model
        self.base_url = base_url
        self.api_key = api_key
        self.engine_kwargs = dict(engine_kwargs or {})
        self._provider = provider
        self._given = provider is not None
        self._lock = threading.Lock()
        self._lora: tuple[str | None] | None = None

    def get(self):
        """The Provider, built now if this is the first call (loads weights / opens the client)."""
        if self._provider is None:
            with self._lock:
                if self._provider is None:
                    if self.base_url is not None:
                        self._provider = remote_engine(self.base_url, self.api_key)
                    else:
                        self._provider = shared_engine(self.model, self.engine_kwargs)
        return self._provider

    @property
    def built(self) -> bool:
        return self._provider is not None

    def lora(self) -> str | None:
        """The LoRA adapter requests run under: `model` when it names one of the provider's adapters (an engine's
        or a server's), else None (the base model). Asked once. ValueError when `model` names neither the given
        engine's model nor one of its adapters."""
        if self._lora is None:
            name = None
            if self.model is not None and (self._given or self.base_url is not None):
                provider = self.get()
                adapters = getattr(provider, "lora_adapters", None)
                if adapters is not None and self.model in adapters():
                    name = self.model
                elif self._given and self.model != getattr(provider, "model_name", self.model):
                    raise ValueError(f"model={self.model!r} is neither the engine's model "
                                     f"({provider.model_name!r}) nor one of its LoRA adapters")
            self._lora = (name,)
        return self._lora[0]

    @property
    def model_name(self) -> str:
        """The model's name, without building an in-process engine to learn it (a LoRA adapter's own name)."""
        if self.model is not None and (self._given or self.base_url is not None) and self.lora() is not None:
            return self.model
        if self._provider is not None and getattr(self._provider, "model_name", None):
            return self._provider.model_name
        if self.model is not None:
            return self.model
        return self.get().model_name

    def model_id(self) -> str:
        """name@revision: identifies the weights, for caches keyed by model string (DSPy's response cache)."""
        name = self.model_name
        revision = None
        if self._provider is not None or self.base_url is not None:
            revision = getattr(self.get(), "model_revision", None)
        elif self.model is not None:
            from prefixrt.hub.registry import resolve_model

            revision = resolve_model(self.model).revision
        if not revision:
            return name
        return revision if str(revision).startswith(f"{name}@") else f"{name}@{revision}"

    def __deepcopy__(self, memo):
        return self  # engines are shared runtime objects, never copied
