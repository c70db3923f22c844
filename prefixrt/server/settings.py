"""`prefixrt serve`'s own settings, declared once like the engine's (config/settings.py `setting`): the server
section and the disaggregation section. Their flags are generated from these declarations (server/launch.py
add_serve_args, config/flags.py add_flags); the parsed flags keep the settings' names.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixrt.config.settings import setting
from prefixrt.engine.progress import DEFAULT_STALL_TIMEOUT_S
from prefixrt.lowering.reasoning import PARSERS as REASONING_PARSERS
from prefixrt.server.admission import DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP server around an engine."""

    host: str = setting("127.0.0.1", "the address to listen on", flag=True)
    port: int = setting(30000, "the port to listen on", flag=True)
    served_model_name: list[str] | None = setting(
        None, "the model names requests may give (aliases; the first is reported in responses and listed first by "
        "/v1/models); default: --model. Another name is a 404 model_not_found", flag=True, nargs="+",
        metavar="NAME")
    generation_config: str = setting(
        "auto", "sampling defaults for requests that leave them out: auto (default) = the model's "
        "generation_config.json (the catalogue's recommendation for a built-in model), vllm = the engine's own "
        "(temperature 1.0), or a folder's generation_config.json", flag=True, metavar="auto|vllm|FOLDER")
    engine_stall_timeout: float = setting(
        DEFAULT_STALL_TIMEOUT_S, "/health answers 503 and in-flight requests fail (503 engine_unresponsive) once "
        "the engine has had work and made no step for this long, or its process has said nothing for this long or "
        "30 s, whichever is less (default 60 s)", flag=True, metavar="S")
    any_model_name: bool = setting(False, "serve requests whatever `model` they name (for code that hard-codes a "
                                   "vendor's model)", flag=True)
    reasoning_parser: str | None = setting(
        None, "the served model's reasoning form: its thinking goes in chat's reasoning_content (streamed as deltas) "
        "and the Responses API's reasoning items; a request turns it off with chat_template_kwargs "
        "{\"enable_thinking\": false} (prefixrt/lowering/reasoning.py)", choices=(None, *REASONING_PARSERS),
        flag=True)
    otlp_traces_endpoint: str | None = setting(
        None, "send a span per OpenAI request (queue/prefill/decode time, token counts, tenant, priority; the "
        "caller's traceparent continued) to this OTLP collector; the OTEL_* environment "
        "(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, ...) turns it on too. Needs prefixrt[tracing]", flag=True,
        metavar="URL")
    log_level: str = setting("info", "uvicorn's log level", choices=("critical", "error", "warning", "info", "debug"),
                             flag=True)
    drain_timeout: float = setting(30.0, "on SIGTERM/SIGINT: seconds in-flight requests get to finish before they "
                                   "are aborted", flag=("--drain-timeout", "--graceful-timeout"))
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` on every route but /health (env "
                                  "PREFIXRT_API_KEY)", flag=True, env="PREFIXRT_API_KEY")
    admin_api_key: str | None = setting(
        None, "the key for /flush_cache, /cache_prefix, /stats, /metrics, /dashboard (env PREFIXRT_ADMIN_API_KEY); "
        "with --api-key alone those routes are off", flag=True, env="PREFIXRT_ADMIN_API_KEY")
    max_request_bytes: int = setting(DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413 (default 32 MiB)",
                                     flag=True)
    engine_in_process: bool = setting(False, "run the engine on a thread of the server process instead of its own "
                                      "process", flag=True)


@dataclass(frozen=True)
class DisaggSettings:
    """Prefill/decode disaggregation (docs/serving.md; disagg/)."""

    role: str = setting(
        "standalone", "prefill: compute prompts' K/V and send it to the decode server; decode: take requests, fetch "
        "their prompts' K/V from the prefill servers, decode (both run the engine in this process); default "
        "standalone", choices=("standalone", "prefill", "decode"), flag=True)
    disagg_addr: str | None = setting(None, "HOST:PORT of the rendezvous (a TCP store hosted by the decode server)",
                                      flag=True)
    disagg_prefill_workers: int = setting(1, "number of prefill servers (default 1)", flag=True)
    disagg_rank: int = setting(1, "--role prefill: this server's rank, 1..N", flag=True)
    disagg_backend: str = setting(
        "gloo", "torch.distributed backend of the K/V streams: gloo (CPU, or a GPU pool staged through host memory; "
        "works with both servers on one GPU) or nccl (device to device)", choices=("gloo", "nccl"), flag=True)
    disagg_timeout: float = setting(300.0, "seconds to wait for the peers to join", flag=True)
    disagg_debug_delay_s: float = setting(0.0, "--role prefill, race mode: sleep this long before each layer is "
                                          "sent (tests)", flag=True)
