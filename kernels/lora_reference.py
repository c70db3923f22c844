"""The batched LoRA update in plain torch (the oracle of kernels/lora.py and the CPU path of the model).

For every block of the plan (kernels/lora_plan.py) with slot s, and every shard i of the projection (q/k/v or
gate/up of a fused linear; one shard otherwise), on the block's rows:
    y[rows, shard i] += (x[rows] @ a[s, i*R : (i+1)*R].T) @ b[s, shard i].T * scale[s, i]
which is PEFT's `lora_B(lora_A(x)) * scaling` added to the base layer's output, op for op, with the adapter's
ranks zero-padded to R (padding adds exact zeros).
"""

from __future__ import annotations

import torch


def lora_apply(
    x: torch.Tensor,  # [T, K] the projection's input
    y: torch.Tensor,  # [T, N] the base projection's output; updated in place
    a: torch.Tensor,  # [S, num_shards * R, K] lora_A of every slot, each shard's rows padded to R
    b: torch.Tensor,  # [S, N, R] lora_B of every slot, columns padded to R
    scale: torch.Tensor,  # [S, num_shards] float32: lora_alpha / r (or / sqrt(r)) per slot and shard
    shard_sizes: list[int],  # output columns of each shard (sum N)
    sorted_tokens: torch.Tensor,  # [T] int32, see lora_plan.py
    block_slot: torch.Tensor,  # [NB] int32
    block_start: torch.Tensor,  # [NB] int32
    block_end: torch.Tensor,  # [NB] int32
) -> torch.Tensor:
    """y with every block's LoRA update added (y itself, updated in place)."""
    rank = b.shape[2]
    order = sorted_tokens.tolist()
    for slot, start, end in zip(block_slot.tolist(), block_start.tolist(), block_end.tolist()):
        if slot < 0 or end <= start:
            continue
        rows = torch.tensor(order[start:end], dtype=torch.int64, device=x.device)
        xa = x[rows] @ a[slot].T  # [m, num_shards * R]
        offset = 0
        for i, size in enumerate(shard_sizes):
            part = xa[:, i * rank:(i + 1) * rank] @ b[slot, offset:offset + size].T  # [m, size]
            y[rows, offset:offset + size] += part * float(scale[slot, i])
            offset += size
    return y
