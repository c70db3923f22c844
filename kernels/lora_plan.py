"""The host side of the batched LoRA kernels (kernels/lora.py): which rows each program reads, as flat index arrays.

A forward's token rows run under different adapters (a GPU slot each) or under none (the base model). The plan
groups the rows by slot without moving them: `sorted_tokens` lists the rows of slot-holding sequences, slot by
slot (the rows of the base model last, where no block reaches them), and each block of at most `block_m`
consecutive entries of one slot is one (block_slot, block_start, block_end) triple. A kernel program takes one
block, so every adapter's weight tiles are read once per block of its rows (segmented, SGMV-style), and a
decode batch spread over many adapters degrades to one row per block (gathered, BGMV-style). Padding blocks
have slot -1 and do nothing: a plan padded to a fixed block count runs inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

EXPAND_BLOCK_N = 64  # output columns per expand program (expand_tiles; kernels/lora.py's BLOCK_N)


def max_blocks(num_tokens: int, num_segments: int, block_m: int) -> int:
    """An upper bound on the blocks of any plan of num_tokens rows in at most num_segments runs of one slot."""
    return -(-num_tokens // block_m) + num_segments


def block_m_for(num_tokens: int, num_seqs: int) -> int:
    """Rows per block: 16 (tl.dot's least) for decode-like batches, taller for long prefills (fewer re-reads of
    the adapter's weights per row)."""
    per_seq = num_tokens / max(num_seqs, 1)
    return 16 if per_seq <= 16 else 32 if per_seq <= 128 else 64


@dataclass(frozen=True)
class LoraPlanLists:
    """A plan as host lists (see the module docstring); the four lists become one int32 tensor per forward."""

    sorted_tokens: list[int]  # [T] token rows, slot-holding sequences' rows grouped by slot, then the base rows
    block_slot: list[int]  # [NB] the slot of each block; -1 = padding
    block_start: list[int]  # [NB] index into sorted_tokens of the block's first row
    block_end: list[int]  # [NB] one past its last (block_end - block_start <= block_m)
    block_m: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_slot)


def plan_lists(row_slots: list[int], row_lens: list[int], block_m: int, num_blocks: int | None = None
               ) -> LoraPlanLists:
    """The plan of a forward whose sequence i feeds row_lens[i] consecutive token rows under slot row_slots[i]
    (-1: the base model). num_blocks: pad the block lists to exactly this many (a CUDA graph's fixed grid);
    ValueError if the plan needs more."""
    if len(row_slots) != len(row_lens):
        raise ValueError(f"{len(row_slots)} slots for {len(row_lens)} sequences")
    starts, acc = [], 0
    for n in row_lens:
        starts.append(acc)
        acc += n
    order = sorted((i for i, s in enumerate(row_slots) if s >= 0), key=lambda i: row_slots[i])  # stable
    sorted_tokens: list[int] = []
    block_slot: list[int] = []
    block_start: list[int] = []
    block_end: list[int] = []
    seg_slot, seg_start = None, 0

    def close_segment(end: int) -> None:
        for b in range(seg_start, end, block_m):
            block_slot.append(seg_slot)
            block_start.append(b)
            block_end.append(min(b + block_m, end))

    for i in order:
        if row_slots[i] != seg_slot:
            if seg_slot is not None:
                close_segment(len(sorted_tokens))
            seg_slot, seg_start = row_slots[i], len(sorted_tokens)
        sorted_tokens.extend(range(starts[i], starts[i] + row_lens[i]))
    if seg_slot is not None:
        close_segment(len(sorted_tokens))
    for i, s in enumerate(row_slots):  # the base model's rows: listed (a full permutation), in no block
        if s < 0:
            sorted_tokens.extend(range(starts[i], starts[i] + row_lens[i]))
    if num_blocks is not None:
        if len(block_slot) > num_blocks:
            raise ValueError(f"the LoRA plan needs {len(block_slot)} blocks, more than the {num_blocks} given")
        pad = num_blocks - len(block_slot)
        block_slot += [-1] * pad
        block_start += [0] * pad
        block_end += [0] * pad
    return LoraPlanLists(sorted_tokens, block_slot, block_start, block_end, block_m)


def expand_tiles(shard_sizes: list[int], block_n: int) -> list[list[int]]:
    """The expand kernel's column tiles: [shard of each tile, its first column, one past the shard's last
    column]; a tile never straddles two shards (q/k/v or gate/up of a fused projection)."""
    shard, first, end = [], [], []
    offset = 0
    for i, size in enumerate(shard_sizes):
        for n0 in range(offset, offset + size, block_n):
            shard.append(i)
            first.append(n0)
            end.append(offset + size)
        offset += size
    return [shard, first, end]
