"""KV transport: one ordered point-to-point stream per peer over a torch.distributed process group.

Used by prefill/decode disaggregation (disagg/decode.py): control messages (small picklable records) and K/V
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

TAG_TO_PREFILL = 11  # decode -> prefill: requests, cancels, end of stream
TAG_TO_DECODE = 12  # prefill -> decode: headers, K/V layers, end of stream


def make_group(addr: str, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0):
    """The process group of one rank: a TCPStore at addr ("host:port", hosted by rank 0) and a gloo or nccl
    group over it. Blocks until every rank has joined (or timeout_s)."""
    import torch.distributed as dist

    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address must be host:port, got {addr!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=(rank == 0), timeout=timeout)
    loopback = host in ("127.0.0.1", "localhost", "::1")  # every rank on this host: gloo binds loopback too
    return _group(dist.PrefixStore("prefixrt-disagg", store), rank, world_size, backend, timeout,
                  bind_host="127.0.0.1" if loopback else None)


def local_groups(world_size: int, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """world_size process groups of THIS process (rank i at index i) over an in-memory store."""
    import torch.distributed as dist

    store = dist.HashStore()
    groups: list = [None] * world_size
    errors: list[BaseException] = []
    timeout = datetime.timedelta(seconds=timeout_s)

    def join(rank: int) -> None:
        try:
            groups[rank] = _group(dist.PrefixStore("prefixrt-local", store), rank, world_size, backend, timeout,
                                  bind_host="127.0.0.1")
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


def _group(store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta, bind_host: str | None = None):
    """bind_host: the address gloo listens on (None: the host's default interface, GLOO_SOCKET_IFNAME honoured)."""
    import torch.distributed as dist

    if backend == "gloo":
        gloo = dist.ProcessGroupGloo
        opts = gloo._Options()
        opts._timeout = timeout
        opts._devices = [gloo.create_device(hostname=bind_host) if bind_host else gloo.create_default_device()]
        opts._threads = 4  # asynchronous collectives in flight at once (layer-split: a broadcast ahead + a gather)
        return gloo(store, rank, world_size, opts)
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
        self._cuda_stream = None  # CUDA pools: this channel's copies run on their own stream

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
        """K and V of `slots` (int64, on the pool's device) of one layer as one [2, n, kvh, d] tensor. On CUDA
        the gather runs on this channel's own stream (the slots are locked: nothing writes them meanwhile) and,
        with gloo, lands in pinned host memory before it is sent."""
        if pool.device.type != "cuda":
            self._send(torch.stack((pool.k_buffers[layer].index_select(0, slots),
                                    pool.v_buffers[layer].index_select(0, slots))))
            return
        stream = self._stream(pool.device)
        with torch.cuda.stream(stream):
            kv = torch.stack((pool.k_buffers[layer].index_select(0, slots),
                              pool.v_buffers[layer].index_select(0, slots)))
            if self.staging:
                host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                host.copy_(kv, non_blocking=True)
                kv = host
        stream.synchronize()
        self._send(kv)

    def recv_layer(self, pool: KVPool, num_tokens: int) -> torch.Tensor:
        """One layer's [2, n, kvh, d] K/V (not yet written into the pool): on the host with gloo, else on the
        pool's device."""
        cuda = pool.device.type == "cuda"
        device = torch.device("cpu") if self.staging or not cuda else pool.device
        shape = (2, num_tokens, pool.num_kv_heads, pool.head_dim)
        buf = torch.empty(shape, dtype=pool.dtype, device=device, pin_memory=cuda and device.type == "cpu")
        if device.type == "cuda":  # nccl: the wait makes this channel's stream (which writes the pool) wait
            with torch.cuda.stream(self._stream(pool.device)):
                self._recv(buf)
        else:
            self._recv(buf)
        return buf

    def write_layer(self, pool: KVPool, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store a received layer's K/V into pool slots (int64 on the pool's device). On CUDA it runs on this
        channel's stream and is complete when this returns, so a layer marked written has landed."""
        if pool.device.type != "cuda":
            write_layer(pool, layer, slots, kv)
            return
        stream = self._stream(pool.device)
        with torch.cuda.stream(stream):
            write_layer(pool, layer, slots, kv.to(pool.device, non_blocking=True))
        stream.synchronize()

    def _stream(self, device: torch.device):
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream(device)
        return self._cuda_stream

    # ------------------------------------------------------------------ the wire
    def _send(self, t: torch.Tensor) -> None:
        self.group.send([t.contiguous()], self.peer, self.send_tag).wait()
        self.bytes_sent += t.numel() * t.element_size()

    def _recv(self, t: torch.Tensor) -> None:
        self.group.recv([t], self.peer, self.recv_tag).wait()
        self.bytes_received += t.numel() * t.element_size()


def write_layer(pool: KVPool, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Store one layer's K/V ([2, n, kvh, d], on the pool's device) into pool slots (int64, same device)."""
    pool.k_buffers[layer].index_copy_(0, slots, kv[0])
    pool.v_buffers[layer].index_copy_(0, slots, kv[1])


def sleep_s(seconds: float) -> None:
    """Race mode's injected delay (a plain sleep; the transfer threads never hold the GIL through it)."""
    if seconds > 0:
        time.sleep(seconds)
