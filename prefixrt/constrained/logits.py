"""Token bitmasks: allocate them, edit rows, and apply them to logits.

A bitmask is int32 [B, W] with W = ceil(vocab / 32); bit j of word w (LSB first) of row b says whether
token 32 * w + j may be sampled in row b. All-ones (-1) rows leave their logits untouched, so rows of
unconstrained requests in a mixed batch simply stay as allocated.
"""

from __future__ import annotations

import torch

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int, device: torch.device | str = "cpu",
                     pinned: bool = False) -> torch.Tensor:
    """An all-ones (everything allowed) int32 bitmask [batch_size, ceil(vocab_size / 32)].

    Matchers fill CPU bitmasks; copy to the logits' device before `apply_token_bitmask`. pinned: in page-locked
    host memory, so that copy is asynchronous (a copy from pageable memory waits for the stream's prior work).
    """
    shape = (batch_size, bitmask_width(vocab_size))
    if torch.device(device).type != "cpu":
        return torch.full(shape, -1, dtype=torch.int32, device=device)
    mask = torch.empty(shape, dtype=torch.int32, pin_memory=pinned)
    mask.numpy().fill(-1)  # one thread: torch.full over this many words would wake every OpenMP worker
    return mask


def _to_int32(bit_word: int) -> int:
    return bit_word - (1 << 32) if bit_word >= 1 << 31 else bit_word


def fill_only(bitmask: torch.Tensor, row: int, token_ids) -> None:
    """Set `bitmask[row]` to allow exactly `token_ids`."""
    bitmask[row].zero_()
    words: dict[int, int] = {}
    for t in token_ids:
        words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
    for w, bits in words.items():
        bitmask[row, w] = _to_int32(bits)


def allowed_token_ids(bitmask: torch.Tensor, row: int, vocab_size: int | None = None) -> torch.Tensor:
    """The ids whose bit is set in `bitmask[row]` (int64 1-D tensor, ascending)."""
    return unpack_bitmask(bitmask[row : row + 1], vocab_size)[0].nonzero().flatten()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """bool [B, vocab_size] (default 32 * W) from int32 [B, W]; True = allowed. Ids past 32 * W are False."""
    batch, width = bitmask.shape
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(batch, 32 * width)  # [B, 32W]
    if vocab_size is None:
        return bits
    if vocab_size <= 32 * width:
        return bits[:, :vocab_size]
    pad = torch.zeros(batch, vocab_size - 32 * width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, pad], dim=1)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [B, ceil(V / 32)] from bool [B, V] (the inverse of `unpack_bitmask`)."""
    batch, vocab = allowed.shape
    width = bitmask_width(vocab)
    padded = torch.zeros(batch, 32 * width, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed.to(torch.int64)
    shifts = torch.arange(32, dtype=torch.int64, device=allowed.device)
    words = (padded.view(batch, width, 32) << shifts).sum(-1)  # [B, W], in [0, 2**32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Reference implementation of `apply_token_bitmask` with torch bit ops (any device)."""
    vocab = logits.shape[-1]
    covered = min(vocab, 32 * bitmask.shape[1])
    allowed = unpack_bitmask(bitmask, covered)  # [B, covered]
    logits[:, :covered].masked_fill_(~allowed, float("-inf"))
    if vocab > covered:
        logits[:, covered:] = float("-inf")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[b, t] = -inf wherever bit t of bitmask[b] is 0. In place.

    logits: float [B, V_model] on CPU or CUDA; bitmask: int32 [B, W] on the same device.
    V_model > 32 * W: the uncovered ids (lm_head padding) are masked. V_model < 32 * W: extra bits ignored.
    On CUDA this uses xgrammar's Triton kernel when it is importable, else the torch version.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must be [B, V] and [B, W]")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, not {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits are on {logits.device}")
    if logits.is_cuda:
        kernel = _cuda_kernel()
        if kernel is not None:
            vocab = logits.shape[1]
            covered = min(vocab, 32 * bitmask.shape[1])
            kernel(logits, bitmask, vocab_size=covered)
            if vocab > covered:
                logits[:, covered:] = float("-inf")
            return
    apply_token_bitmask_torch(logits, bitmask)


_CUDA_KERNEL: list = []


def _cuda_kernel():
    if not _CUDA_KERNEL:
        try:
            import triton  # noqa: F401  (xgrammar's CUDA path is a Triton kernel)
            from xgrammar import apply_token_bitmask_inplace
        except ImportError:
            apply_token_bitmask_inplace = None
        _CUDA_KERNEL.append(apply_token_bitmask_inplace)
    return _CUDA_KERNEL[0]
