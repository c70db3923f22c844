"""The step protocol of tensor parallelism: rank 0 drives, the other ranks follow.

Rank 0 owns the scheduler, the radix tree and the request table's host side; the other ranks own nothing but
their shard of the model, their slice of the KV pool (the same slots, their KV heads) and a device copy of the
request table. `TPDriverRunner` (rank 0) is a ModelRunner that, before each thing it runs on the device, tells
the other ranks to run the same thing; `follow` is the other ranks' loop. So every rank runs the same forwards,
in the same order, on the same slots: aborts, retraction, eviction and slot reuse happen on rank 0's host only
and reach the others as nothing but the slots of later forwards. Invariant: a rank's pool slot s holds, for its
KV heads, exactly what rank 0's slot s holds for rank 0's.

Messages, broadcast from rank 0 (host ints on the `control` group, gloo; device tensors on the device group):
    header    int64[HEADER]: op, T (tokens), B (sequences), L (logits rows), J (table writes), G (group ints), eager, decode
    FORWARD   host int64[3B + 3J + G]: seq_lens, prefix_lens, extend_lens (the backends plan from these), the
              request-table writes flushed since the last forward (rows, cols, slots), the prefix groups;
              then device int64[3T + 5B + L]: input_ids, positions, out_cache_loc, req_pool_indices, seq_lens,
              prefix_lens, extend_lens, extend_start_loc, logits_indices (input_ids as they are on the device
              at launch: tokens the overlapped loop fills from the previous step are in)
    CAPTURE   host int64[CAPTURE_INTS]: the capture_graphs arguments, the CascadeSpec's fields last (every rank
              captures the same graphs, its collectives inside them)
    RELEASE   release_graphs()
    SHUTDOWN  the followers return (Engine.shutdown, after the loop has stopped)
A failure on rank 0 after a message was sent leaves the ranks out of step: the driver refuses every later
forward (the engine must be restarted) rather than deadlock in a mismatched collective.
"""

from __future__ import annotations

import dataclasses
import logging
from itertools import chain

import torch

from prefixrt.model.cuda_graphs import CascadeSpec
from prefixrt.model.forward_batch import ForwardBatch, ForwardMode
from prefixrt.model.runner import ModelRunner
from prefixrt.parallel.layers import TPGroup

log = logging.getLogger("prefixrt")

HEADER = 8
FORWARD, CAPTURE, RELEASE, SHUTDOWN = 1, 2, 3, 4
CASCADE_FIELDS = [f.name for f in dataclasses.fields(CascadeSpec)]
CAPTURE_INTS = 6 + len(CASCADE_FIELDS)


def _broadcast(tensor: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    dist.broadcast(tensor, src=0, group=group)
    return tensor


def _encode_groups(groups: list[tuple[int, list[int]]] | None) -> list[int]:
    """prefix_groups -> [n, (prefix_len, k, i_1..i_k) * n]; [] for None."""
    if groups is None:
        return []
    return [len(groups), *chain.from_iterable([p, len(idx), *idx] for p, idx in groups)]


def _decode_groups(flat: list[int]) -> list[tuple[int, list[int]]] | None:
    if not flat:
        return None
    groups, at = [], 1
    for _ in range(flat[0]):
        p, k = flat[at], flat[at + 1]
        groups.append((p, flat[at + 2: at + 2 + k]))
        at += 2 + k
    return groups


def _encode_capture(pad_row: int, max_batch_size: int, max_context: int, max_extend_tokens: int, emulate: bool,
                    cascade: CascadeSpec | None) -> list[int]:
    """capture_graphs' arguments (after req_to_token) -> CAPTURE_INTS ints, the CascadeSpec's fields last."""
    spec = list(dataclasses.astuple(cascade)) if cascade is not None else [0] * len(CASCADE_FIELDS)
    return [pad_row, max_batch_size, max_context, max_extend_tokens, int(emulate), int(cascade is not None), *spec]


def _decode_capture(a: list[int]) -> tuple:
    """_encode_capture's ints -> capture_graphs' positional arguments after req_to_token."""
    return a[0], a[1], a[2], a[3], bool(a[4]), CascadeSpec(*a[6:]) if a[5] else None


class TPDriverRunner(ModelRunner):
    """Rank 0's runner: ModelRunner's forward, warm_up, capture_graphs and release_graphs, each announced to the
    other ranks first. `table` is the request table (cache/req_table.py); its journal carries the writes the
    other ranks apply before each forward."""

    def __init__(self, model, pool, attn_backend, tp: TPGroup, table):
        super().__init__(model, pool, attn_backend)
        self.tp = tp
        self.table = table
        table.journal = []
        self.broken: str | None = None  # why the ranks may be out of step (then every forward raises)
        self._stopped = False  # the other ranks were told to return

    # ---- messages
    def _header(self, op: int, *fields: int) -> None:
        head = [op, *fields] + [0] * (HEADER - 1 - len(fields))
        _broadcast(torch.tensor(head, dtype=torch.int64), self.tp.control)

    def _announce_forward(self, batch: ForwardBatch, eager: bool) -> None:
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel ranks are out of step ({self.broken}); restart the engine")
        journal = self.table.journal
        writes = torch.cat(journal, dim=1) if journal else torch.empty((3, 0), dtype=torch.int64)
        journal.clear()
        groups = _encode_groups(batch.prefix_groups)
        T, B, L = batch.num_tokens, batch.batch_size, int(batch.logits_indices.shape[0])
        J = int(writes.shape[1])
        self._header(FORWARD, T, B, L, J, len(groups), int(eager), int(batch.mode is ForwardMode.DECODE))
        host = torch.tensor(batch.seq_lens_cpu + batch.prefix_lens_cpu + batch.extend_lens_cpu, dtype=torch.int64)
        host = torch.cat([host, writes.reshape(-1), torch.tensor(groups, dtype=torch.int64)])
        _broadcast(host, self.tp.control)
        dev = torch.cat([batch.input_ids, batch.positions, batch.out_cache_loc, batch.req_pool_indices,
                         batch.seq_lens.long(), batch.prefix_lens.long(), batch.extend_lens.long(),
                         batch.extend_start_loc.long(), batch.logits_indices])
        _broadcast(dev, self.tp.group)

    def _guarded(self, what: str, fn):
        try:
            return fn()
        except Exception as e:
            self.broken = f"{what} failed on rank 0: {e}"
            raise

    # ---- ModelRunner
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._announce_forward(batch, eager=False)
        return self._guarded("a forward", lambda: super(TPDriverRunner, self).forward(batch))

    def warm_up(self, batches) -> float:
        import time

        t0 = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                self._announce_forward(batch, eager=True)
                self._guarded("a warm-up forward", lambda b=batch: self._forward_eager(b))
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        return time.perf_counter() - t0

    def capture_graphs(self, req_to_token: torch.Tensor, pad_row: int, max_batch_size: int, max_context: int,
                       max_extend_tokens: int = 0, emulate: bool = False,
                       cascade: CascadeSpec | None = None, max_verify_tokens: int = 0) -> list[str]:
        # max_verify_tokens is not sent to the ranks: speculative verify forwards run eagerly under TP
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel ranks are out of step ({self.broken})")
        self.release_graphs()  # announced now (ModelRunner.capture_graphs releases too, silently: none are left)
        args = _encode_capture(pad_row, max_batch_size, max_context, max_extend_tokens, emulate, cascade)
        self._header(CAPTURE)
        _broadcast(torch.tensor(args, dtype=torch.int64), self.tp.control)
        return self._guarded("CUDA graph capture", lambda: super(TPDriverRunner, self).capture_graphs(
            req_to_token, pad_row, max_batch_size, max_context, max_extend_tokens, emulate, cascade))

    def release_graphs(self) -> None:
        if not self._stopped and self.broken is None and (self.graphs is not None or self.extend_graphs is not None):
            self._header(RELEASE)
        super().release_graphs()

    def stop_followers(self) -> None:
        """Tell the other ranks to return (once; after the loop has stopped: nothing is in flight)."""
        if not self._stopped:
            self._stopped = True
            self._header(SHUTDOWN)


def follow(runner: ModelRunner, req_to_token: torch.Tensor, tp: TPGroup) -> None:
    """The loop of a rank other than 0: run what rank 0 announces, on this rank's shard and pool slice, until
    SHUTDOWN. req_to_token: this rank's device copy of the request table (rank 0's journal keeps it equal)."""
    device = req_to_token.device
    header = torch.empty(HEADER, dtype=torch.int64)
    while True:
        op, T, B, L, J, G, eager, decode = _broadcast(header, tp.control).tolist()
        if op == SHUTDOWN:
            return
        if op == RELEASE:
            runner.release_graphs()
            continue
        if op == CAPTURE:
            a = _broadcast(torch.empty(CAPTURE_INTS, dtype=torch.int64), tp.control).tolist()
            runner.capture_graphs(req_to_token, *_decode_capture(a))
            continue
        if op != FORWARD:
            raise RuntimeError(f"unknown tensor-parallel message {op}")
        host = _broadcast(torch.empty(3 * B + 3 * J + G, dtype=torch.int64), tp.control)
        dev = _broadcast(torch.empty(3 * T + 5 * B + L, dtype=torch.int64, device=device), tp.group)
        lens = host[: 3 * B].tolist()
        if J:
            writes = host[3 * B: 3 * B + 3 * J].view(3, J).to(device)
            req_to_token[writes[0], writes[1]] = writes[2].to(torch.int32)
        groups = _decode_groups(host[3 * B + 3 * J:].tolist())
        ids, pos, loc, rows, seq, pre, ext, start, logit = torch.split(dev, [T, T, T, B, B, B, B, B, L])
        batch = ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=rows,
            seq_lens=seq.to(torch.int32), prefix_lens=pre.to(torch.int32), extend_lens=ext.to(torch.int32),
            extend_start_loc=start.to(torch.int32), req_to_token=req_to_token, logits_indices=logit,
            seq_lens_cpu=lens[:B], prefix_lens_cpu=lens[B: 2 * B], extend_lens_cpu=lens[2 * B:],
            prefix_groups=groups,
        )
        with torch.inference_mode():
            if eager:
                runner._forward_eager(batch)
            else:
                runner.forward(batch)
