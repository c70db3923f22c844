"""KV transport: one ordered point-to-point stream per peer over a torch.distributed process group.

Used by prefill/decode disaggregation (engine/disagg.py): control messages (small picklable records) and K/V
(one tensor [2, n, kv_heads, head_dim] per layer: K then V of n tokens) travel on the same stream, in order, so
a record sent after a transfer's last layer arrives after every layer of it. Each direction has its own tag, and
each side has exactly one sending and one receiving thread per peer (torch.distributed keeps order per
(peer, tag)).

Backends: gloo sends CPU tensors (a CUDA pool is staged through host memory: this is also what works for two
engines on ONE GPU, where NCCL refuses two ranks on the same device); nccl sends device tensors.
Groups come from `make_group` (a TCPStore rendezvous, one process per rank) or `local_groups` (every rank in
this process, each in its own thread: tests and the in-process pair).
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time

import torch

from prefixrt.cache.kv_pool import KVPool

TAG_TO_PREFILL = 11  # decode -> prefill: requests, cancels, bye
TAG_TO_DECODE = 12  # prefill -> decode: headers, K/V layers, bye


def make_group(addr: str, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0):
    """The process group of one rank: a TCPStore at addr ("host:port", hosted by rank 0) and a gloo or nccl
    group over it. Blocks until every rank has joined (or timeout_s)."""
    import torch.distributed as dist

    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address must be host:port, got {addr!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=(rank == 0), timeout=timeout)
    return _group(dist.PrefixStore("prefixrt-disagg", store), rank, world_size, backend, timeout)


def local_groups(world_size: int, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """world_size process groups of THIS process (rank i at index i) over an in-memory store."""
    import torch.distributed as dist

    store = dist.HashStore()
    groups: list = [None] * world_size
    errors: list[BaseException] = []
    timeout = datetime.timedelta(seconds=timeout_s)

    def join(rank: int) -> None:
        try:
            groups[rank] = _group(dist.PrefixStore("prefixrt-local", store), rank, world_size, backend, timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return groups


def _group(store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta):
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


class Channel:
    """The stream to one peer in one direction pair: send on `send_tag`, receive on `recv_tag`. send_* may be
    called from one thread at a time (a lock keeps a multi-part message whole); recv_* from one thread."""

    def __init__(self, group, peer: int, send_tag: int, recv_tag: int, backend: str = "gloo"):
        self.group = group
        self.peer = peer
        self.send_tag = send_tag
        self.recv_tag = recv_tag
        self.staging = backend == "gloo"  # gloo moves CPU tensors only
        self.send_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    # ------------------------------------------------------------------ records
    def send_obj(self, obj) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self._send(size)
        self._send(payload)

    def recv_obj(self):
        size = torch.empty(1, dtype=torch.int64)
        self._recv(size)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self._recv(payload)
        return pickle.loads(payload.numpy().tobytes())

    # ------------------------------------------------------------------ K/V
    def send_layer(self, pool: KVPool, layer: int, slots: torch.Tensor) -> None:
        """K and V of `slots` (int64, on the pool's device) of one layer as one [2, n, kvh, d] tensor."""
        kv = torch.stack((pool.k_buffers[layer].index_select(0, slots), pool.v_buffers[layer].index_select(0, slots)))
        if self.staging and kv.device.type != "cpu":
            kv = kv.cpu()
        self._send(kv)

    def recv_layer(self, pool: KVPool, num_tokens: int) -> torch.Tensor:
        """One layer's [2, n, kvh, d] K/V, on the pool's device (not yet written into the pool)."""
        device = torch.device("cpu") if self.staging else pool.device
        buf = torch.empty((2, num_tokens, pool.num_kv_heads, pool.head_dim), dtype=pool.dtype, device=device)
        self._recv(buf)
        return buf.to(pool.device, non_blocking=False)

    # ------------------------------------------------------------------ the wire
    def _send(self, t: torch.Tensor) -> None:
        self.group.send([t.contiguous()], self.peer, self.send_tag).wait()
        self.bytes_sent += t.numel() * t.element_size()

    def _recv(self, t: torch.Tensor) -> None:
        self.group.recv([t], self.peer, self.recv_tag).wait()
        self.bytes_received += t.numel() * t.element_size()


def write_layer(pool: KVPool, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Store a received layer's K/V ([2, n, kvh, d]) into pool slots (int64 on the pool's device). On CUDA the
    copy is synchronised before returning, so a transfer marked done has really landed."""
    pool.k_buffers[layer].index_copy_(0, slots, kv[0])
    pool.v_buffers[layer].index_copy_(0, slots, kv[1])
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()


def sleep_s(seconds: float) -> None:
    """Race mode's injected delay (a plain sleep; the transfer threads never hold the GIL through it)."""
    if seconds > 0:
        time.sleep(seconds)
