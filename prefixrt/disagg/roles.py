"""Starting one side of prefill/decode disaggregation in this process (`prefixrt serve --role prefill|decode`):
the engine, then the torch.distributed group of the decode server and its prefill servers.

The decode server is rank 0 and hosts the rendezvous at `addr`; prefill servers are ranks 1..prefill_workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def start_role(role: str, model: str, engine_kwargs: dict[str, Any], *, addr: str, prefill_workers: int,
               rank: int = 0, backend: str = "gloo", timeout_s: float = 300.0, debug_delay_s: float = 0.0,
               progress: Callable[[str], None] = lambda msg: None):
    """role "decode": a DecodeEngine connected to the prefill ranks; "prefill": an Engine whose PrefillWorker
    serves the decode server (rank: this server's, 1..prefill_workers; debug_delay_s: race mode, a sleep before
    each layer is sent). Returns (engine, the PrefillWorker or None); the engine is shut down if joining fails."""
    from prefixrt.disagg.decode import DecodeEngine
    from prefixrt.disagg.prefill import PrefillWorker
    from prefixrt.engine.engine import Engine
    from prefixrt.parallel.kv_transport import make_group

    if engine_kwargs.get("tp_size", 1) > 1:  # the transfers would fill rank 0's slice of the KV pool only
        raise ValueError(f"--role {role} does not support --tp > 1 yet")
    world = prefill_workers + 1
    rank = 0 if role == "decode" else rank
    make = DecodeEngine if role == "decode" else Engine
    progress(f"starting the {role} engine for {model!r} (in this process)")
    eng = make(model, progress=progress, **engine_kwargs)
    progress(f"joining the disaggregation group at {addr} as rank {rank} of {world} ({backend})")
    try:
        group = make_group(addr, rank, world, backend, timeout_s=timeout_s)
        if role == "decode":
            eng.connect(group, range(1, world), backend=backend)
            worker = None
        else:
            worker = PrefillWorker(eng, group, decode_ranks=(0,), backend=backend, delay_s=debug_delay_s)
    except BaseException:
        eng.shutdown()
        raise
    progress(f"{role} engine ready: {eng.model_name} on {eng.device}")
    return eng, worker
