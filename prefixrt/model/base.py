"""The model interface: what the runner, the engine and the KV pool may rely on, for every family.

A model maps a ForwardBatch to logits and knows nothing about requests, the radix tree or the scheduler.
All attention goes through the AttentionBackend passed to forward(); the model only describes its layers
(`attention_layers`) so the engine can size the KV pool and backends can plan.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from prefixrt.model.attention.base import AttentionBackend, AttentionLayer
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.model.layers import MergedLinear, RotaryEmbedding


def eos_ids_from_hf(hf_config) -> tuple[int, ...]:
    """A transformers config's eos_token_id (None, an int or a list) as a tuple."""
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class CausalLM(nn.Module, ABC):
    """Base class of every model family.

    Subclasses build their modules with transformers' checkpoint names (`model.embed_tokens`,
    `model.layers.N...`, `lm_head`; fused projections are `MergedLinear`s whose shards carry the checkpoint
    names), fill `attention_layers`, and implement `forward`. Weight loading is generic (`load_weights`).
    """

    attention_layers: list[AttentionLayer]
    # (k_scales, v_scales) [num_layers, num_kv_heads] float32 when the checkpoint carries FP8 K/V cache scales (set by
    # the loader, hub/fp8_checkpoint.py), else None
    kv_cache_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(
        self, *, vocab_size: int, max_context: int, eos_token_ids: Iterable[int], tie_word_embeddings: bool
    ):
        super().__init__()
        self._vocab_size = vocab_size
        self._max_context = max_context
        self.tie_word_embeddings = tie_word_embeddings
        self.eos_token_ids: list[int] = list(eos_token_ids)  # may be empty
        self.attention_layers = []

    @abstractmethod
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Run all of batch.input_ids through the model, writing their K/V into the pool via `attn`.

        Returns float32 logits [len(batch.logits_indices), vocab_size] for the rows batch.logits_indices of
        the flat token list. Mutates only the KV pool (through the backend)."""

    def release_weights(self) -> None:
        """Free the weights and every device copy the modules keep (the model is unusable afterwards)."""
        self.to("meta")
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.drop_device_copy()

    # ---- dimensions the engine needs to size the KV pool and check requests ----
    @property
    def num_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def num_kv_heads(self) -> int:
        return self.attention_layers[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention_layers[0].head_dim

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int:
        """max_position_embeddings: the longest sequence (prompt + output) the model supports."""
        return self._max_context

    # ---- weights ----
    def tie_weights(self) -> None:
        """Make lm_head share the embedding matrix when the config ties them. Called at construction and
        again by the loader once parameters are materialised on their device (that breaks sharing)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def ignored_checkpoint_names(self, name: str) -> bool:
        """Checkpoint tensors that exist in some checkpoints but have no parameter of their own here."""
        if self.tie_word_embeddings and name == "lm_head.weight":
            return True  # a copy of the embedding some checkpoints store anyway
        return name.endswith("rotary_emb.inv_freq")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names, `model.` prefix included) into the parameters,
        converting dtype and device. Raises if a name is unknown or a parameter is left unfilled.

        A module with a `load_part(kind, tensor, shard)` method (the tensor-parallel layers of parallel.py) holds
        only part of its checkpoint tensors: the method returns that part, which is what gets copied."""
        # checkpoint name -> (param, row offset, rows, module, shard name): module.load_part slices, if it has one
        targets: dict[str, tuple[torch.Tensor, int, int, nn.Module, str | None]] = {}
        modules = dict(self.named_modules())
        for name, param in self.named_parameters():
            mod_name = name.rsplit(".", 1)[0] if "." in name else ""
            module = modules[mod_name]
            rows = module.out_features if name.endswith(".weight_scale") else param.shape[0]  # (block scales: rows)
            targets[name] = (param, 0, rows, module, None)
        for mod_name, module in modules.items():
            if not isinstance(module, MergedLinear):
                continue
            parent = mod_name.rsplit(".", 1)[0] if "." in mod_name else ""
            for shard in module.shard_names:
                offset, size = module.shard_slice(shard)
                for kind in ("weight", "bias", "weight_scale"):
                    param = getattr(module, kind)
                    if param is not None:
                        shard_name = f"{parent}.{shard}.{kind}" if parent else f"{shard}.{kind}"
                        targets[shard_name] = (param, offset, size, module, shard)
                for kind in ("weight", "bias", "weight_scale"):
                    targets.pop(f"{mod_name}.{kind}", None)

        filled: dict[str, int] = {}  # checkpoint name -> times filled
        unexpected: list[str] = []
        for name, tensor in weights:
            if name not in targets:
                if not self.ignored_checkpoint_names(name):
                    unexpected.append(name)
                continue
            param, offset, size, module, shard = targets[name]
            kind = name.rsplit(".", 1)[1]
            load_part = getattr(module, "load_part", None)
            if load_part is not None:
                tensor = load_part(kind, tensor, shard)
            checkpoint_slice = getattr(module, "checkpoint_slice", None)  # (layers.Linear: FP8 scale layouts)
            if checkpoint_slice is not None:
                dest, tensor = checkpoint_slice(kind, param, offset, size, tensor)
            else:
                dest = param.data.narrow(0, offset, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled[name] = filled.get(name, 0) + 1
        if unexpected:
            raise ValueError(f"checkpoint has tensors this model does not know: {unexpected[:10]}"
                             f"{' ...' if len(unexpected) > 10 else ''}")
        missing = sorted(n for n in targets if n not in filled)
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        self.tie_weights()
