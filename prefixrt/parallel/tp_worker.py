"""Tensor-parallel ranks: starting them, the rendezvous, rank 0's strategy (TensorParallelRanks, what the engine's
builder calls: engine/ranks.py), and the loop of every rank but 0.

Rank 0 is the engine itself (the process that runs the scheduler loop: the caller's for Engine, the engine
process for `prefixrt serve`); ranks 1..tp_size-1 are processes started here with torch.multiprocessing (spawn),
tp_size / nnodes per node, node 0 holding ranks 0..n-1. Rank r runs on cuda:(its local index) on CUDA.

Start-up, in the same order on every rank (each step a collective or a message from rank 0):
    1. rendezvous at dist_init_addr (torch.distributed, NCCL on CUDA and gloo on the CPU; a gloo control group)
    2. load this rank's shard of the model (hub/loader.py with the group: each checkpoint tensor is sliced)
    3. agree on the KV pool size: the smallest any rank can hold (CUDA: free memory differs per device)
    4. rank 0 sends the request-table shape and max_running; each rank builds its pool slice, table copy,
       attention backend and runner
    5. rank 0's builder warms up and captures CUDA graphs through its TPDriverRunner (announced, so every rank
       runs and captures the same); then the other ranks follow (parallel/tp_runner.py) until SHUTDOWN.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from prefixrt.config.engine_config import EngineConfig
from prefixrt.parallel.layers import TPGroup

log = logging.getLogger("prefixrt")

# Idle ranks wait in a broadcast for rank 0's next message for as long as the server is idle: no timeout that an
# idle night could reach. A rank whose peer dies gets a connection error at once instead.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
SETUP_INTS = 4  # num_slots, table rows, table columns, max_running
JOIN_TIMEOUT_S = 30.0


@dataclass
class TensorParallelRanks:
    """Rank 0's handle on the group (its TPGroup, its device, the worker processes it started) and the builder's
    rank strategy for tensor parallelism: engine/ranks.py says what each method is for."""

    tp: TPGroup
    device: torch.device
    spec: Any = None  # the model's hub.loader.ModelSpec, read once here and handed to every rank
    workers: object = None  # torch.multiprocessing ProcessContext (the ranks of this node), or None
    stopped: bool = False

    @property
    def size(self) -> int:
        return self.tp.size

    @classmethod
    def start(cls, config: EngineConfig, model_path=None, say=None) -> TensorParallelRanks:
        """Start this node's other ranks and join the rendezvous as rank 0 (see start_group)."""
        from prefixrt.hub.loader import read_model_spec

        if say is not None:
            say(f"starting {config.tp_size} tensor-parallel ranks ({config.nnodes} node(s))")
        spec = read_model_spec(model_path)
        tp, device, workers = start_group(config, str(model_path), spec)
        return cls(tp, device, spec, workers)

    def load_model(self, path, config: EngineConfig, dtype: torch.dtype, calibration_ids=None):
        """This rank's shard (each checkpoint tensor sliced as it is read). calibration_ids is not used: FP8 weights,
        which it calibrates, are refused with tensor parallelism (EngineConfig)."""
        from prefixrt.hub.loader import load_model

        return load_model(path, load_format=config.load_format, dtype=dtype, device=self.device, tp=self.tp,
                          spec=self.spec)

    def agree_num_slots(self, num_slots: int) -> int:
        return agree_num_slots(self.tp, num_slots)

    def send_setup(self, num_slots: int, table_rows: int, table_cols: int, max_running: int) -> None:
        send_setup(self.tp, num_slots, table_rows, table_cols, max_running)

    def make_runner(self, config: EngineConfig, model, pool, max_running: int, startup=None, say=None, table=None):
        """The TPDriverRunner that drives the other ranks through `table`'s journal."""
        from prefixrt.model import rank_setup
        from prefixrt.parallel.tp_runner import TPDriverRunner

        attention = rank_setup.make_attention(config, model, pool, self.device, max_running, startup, say)
        return TPDriverRunner(model, pool, attention, self.tp, table)

    def on_capture_failure(self, error: Exception) -> None:
        """The other ranks captured (or failed) on their own: no common retry."""
        raise RuntimeError(f"CUDA graph capture failed with tensor parallelism: {error}; start with "
                           "cuda_graph=False to run eagerly") from error

    def stop(self, runner=None) -> None:
        """At shutdown (the loop has stopped): tell the others to return, wait for them, leave the group. runner:
        rank 0's TPDriverRunner (None when building failed before it existed)."""
        stop(self, runner)


def ranks_per_node(config: EngineConfig) -> int:
    return config.tp_size // config.nnodes


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    from prefixrt.model.rank_setup import resolve_device

    device = resolve_device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + local_rank)
    return device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, config: EngineConfig, device: torch.device) -> TPGroup:
    """Join the rendezvous at config.dist_init_addr as `rank`; the default group is the device group."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: one tensor-parallel engine "
                           "per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{config.dist_init_addr}", rank=rank,
                            world_size=config.tp_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend != "gloo" else None
    group = dist.group.WORLD
    return TPGroup(rank=rank, size=config.tp_size, group=group, control=control if control is not None else group)


def start_group(config: EngineConfig, model_path: str | None = None, spec=None):
    """On node 0: start this node's other ranks and join the rendezvous as rank 0 (without dist_init_addr: a free
    port on 127.0.0.1). model_path, spec: the resolved folder and its hub.loader.ModelSpec, handed to the ranks
    (they need not resolve the model nor import transformers). Kills the started ranks if joining fails."""
    import torch.multiprocessing as mp

    if config.node_rank != 0:
        raise ValueError("only node 0 runs the engine; other nodes run `prefixrt serve --node-rank N` (workers only)")
    if config.dist_init_addr is None:
        config = dataclasses.replace(config, dist_init_addr=f"127.0.0.1:{_free_port()}")
    device = rank_device(config, 0)
    if device.type == "cuda":
        needed, visible = (device.index or 0) + ranks_per_node(config), torch.cuda.device_count()
        if needed > visible:
            raise ValueError(f"tensor parallelism needs cuda:{device.index or 0}..cuda:{needed - 1} on this node "
                             f"({ranks_per_node(config)} ranks), {visible} GPU(s) visible")
    workers = None  # node 0's other ranks (none when it has one rank: the others are on other nodes)
    if ranks_per_node(config) > 1:
        workers = mp.start_processes(_worker_main, args=(config, model_path, spec), nprocs=ranks_per_node(config) - 1,
                                     join=False, daemon=True, start_method="spawn")
    try:
        tp = _rendezvous_watching(config, device, workers)
    except BaseException:
        _kill(workers)
        raise
    return tp, device, workers


def _rendezvous_watching(config: EngineConfig, device: torch.device, workers) -> TPGroup:
    """init_group as rank 0, on a helper thread, while watching this node's ranks: one that exits before the
    rendezvous completes (a bad device, an import error) would otherwise leave rank 0 waiting for it forever."""
    import threading

    result: dict = {}

    def join() -> None:
        try:
            result["tp"] = init_group(0, config, device)
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=join, name="prefixrt-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
        dead = [(i + 1, p.exitcode) for i, p in enumerate(workers.processes if workers else [])
                if p.exitcode is not None]
        if dead and thread.is_alive():
            rank, code = dead[0]
            raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up (exit code {code}); its error "
                               "is printed above")
    if "error" in result:
        raise result["error"]
    return result["tp"]


def agree_num_slots(tp: TPGroup, num_slots: int) -> int:
    """The smallest KV pool any rank can hold (a collective: every rank calls it once, at start-up)."""
    import torch.distributed as dist

    t = torch.tensor([num_slots], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.control)
    return int(t.item())


def send_setup(tp: TPGroup, num_slots: int, table_rows: int, table_cols: int, max_running: int) -> None:
    import torch.distributed as dist

    dist.broadcast(torch.tensor([num_slots, table_rows, table_cols, max_running], dtype=torch.int64), src=0,
                   group=tp.control)


def stop(ranks: TensorParallelRanks | None, runner=None) -> None:
    """Rank 0, at shutdown (the loop has stopped): tell the others to return, wait for them, leave the group."""
    if ranks is None or ranks.stopped:
        return
    ranks.stopped = True
    import torch.distributed as dist

    try:
        if runner is not None:
            runner.stop_followers()
    except Exception:
        log.error("telling the tensor-parallel ranks to stop failed: %s", traceback.format_exc())
    if ranks.workers is not None and runner is not None:  # told to return: give them the time to
        try:
            _join(ranks.workers, JOIN_TIMEOUT_S)
        except Exception:
            log.error("a tensor-parallel rank failed: %s", traceback.format_exc())
        _kill(ranks.workers)
    if dist.is_initialized():
        dist.destroy_process_group()


def _join(workers, timeout_s: float) -> bool:
    """Wait up to timeout_s for every process of a ProcessContext; True if all exited (raises if one failed)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not workers.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            return False
    return True


def _kill(workers) -> None:
    if workers is None:
        return
    for p in workers.processes:
        if p.is_alive():
            p.terminate()
    for p in workers.processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()


def run_node(config: EngineConfig) -> int:
    """A node other than 0 (`prefixrt serve --node-rank N`): start its ranks and wait until they return."""
    import torch.multiprocessing as mp

    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine, not workers only")
    ctx = mp.start_processes(_worker_main, args=(config, None, None), nprocs=ranks_per_node(config), join=False,
                             daemon=True, start_method="spawn")
    try:
        while not ctx.join():
            pass
    except Exception as e:
        log.error("tensor-parallel rank failed: %s", e)
        _kill(ctx)
        return 1
    return 0


def _detach_signals() -> None:
    """A rank's lifetime is rank 0's to end (SHUTDOWN, or its connections closing when it dies). torch's spawn
    wrapper asks Linux for SIGINT when the *thread* that started the rank exits (an Engine built on a thread that
    then ends would lose its ranks): cancel that. Ctrl-C reaches the whole process group: ignored, as the engine
    process ignores it (rank 0 shuts the ranks down)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 0)


def _worker_main(index: int, config: EngineConfig, model_path: str | None, spec) -> None:
    """Entry point of a spawned rank. index: its number among the processes this node started; model_path and
    spec: see start() (None: resolved and read here)."""
    _detach_signals()
    local_rank = index + (1 if config.node_rank == 0 else 0)  # node 0's local rank 0 is the engine
    rank = config.node_rank * ranks_per_node(config) + local_rank
    device = rank_device(config, local_rank)
    if device.type == "cpu":  # the node's cores are shared by its ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node(config)))
    tp = init_group(rank, config, device)
    import torch.distributed as dist

    try:
        run_rank(config, tp, device, model_path, spec)
    except BaseException:
        print(f"tensor-parallel rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()
    # Nothing is left to clean up, and the interpreter's teardown of torch takes seconds that rank 0's shutdown
    # would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(config: EngineConfig, tp: TPGroup, device: torch.device, model_path: str | None = None,
             spec=None) -> None:
    """Steps 2-5 of the module docstring for a rank other than 0."""
    import torch.distributed as dist

    from prefixrt.cache.kv_pool import KVPool
    from prefixrt.cache.kv_setup import pool_slots
    from prefixrt.hub.loader import load_model
    from prefixrt.hub.registry import resolve_model
    from prefixrt.model import rank_setup
    from prefixrt.parallel.tp_runner import follow

    dtype = rank_setup.resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)
    path = model_path if model_path is not None else resolve_model(config.model).path
    model = load_model(path, load_format=config.load_format, dtype=dtype, device=device, tp=tp, spec=spec)
    bytes_per_token = KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype)
    agree_num_slots(tp, pool_slots(config, bytes_per_token, device))
    setup = torch.empty(SETUP_INTS, dtype=torch.int64)
    dist.broadcast(setup, src=0, group=tp.control)
    num_slots, table_rows, table_cols, max_running = setup.tolist()
    pool = KVPool(num_slots, model.num_layers, model.num_kv_heads, model.head_dim, dtype, device)
    req_to_token = torch.zeros((table_rows, table_cols), dtype=torch.int32, device=device)
    runner = rank_setup.make_runner(config, model, pool, device, max_running)
    follow(runner, req_to_token, tp)
