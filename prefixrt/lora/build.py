"""The engine's LoRA at start-up: check the model can take adapters, give its target projections their GPU slots,
load the start-up adapters (EngineConfig.lora_adapters). Called by engine/builder.py before the KV pool is sized
(the slots take device memory) and before CUDA graphs are captured (the graphs read the slots)."""

from __future__ import annotations

import torch

from prefixrt.config import EngineConfig
from prefixrt.lora.manager import LoraManager
from prefixrt.lora.peft_format import read_adapter
from prefixrt.model.cuda_graphs import LoraGraphSpec
from prefixrt.model.lora import attach_lora_slots

DEFAULT_MAX_RANK = 16


def build_lora(config: EngineConfig, model, device: torch.device, dtype: torch.dtype, say=print
               ) -> tuple[LoraManager | None, LoraGraphSpec | None]:
    """(the engine's LoraManager with its start-up adapters registered, how CUDA graphs run LoRA), or (None, None)
    when LoRA is off. The update runs on the Triton kernels where the model runs its fused kernels (Triton attention
    on CUDA), else on the torch reference. ValueError on a model or adapter it cannot serve."""
    if not config.lora_enabled:
        return None, None
    kernels = device.type == "cuda" and config.attention_backend != "torch"
    if getattr(model, "vision", None) is not None:
        raise ValueError("LoRA adapters are not supported on vision-language models")
    adapters = {name: read_adapter(name, path, dtype) for name, path in (config.lora_adapters or {}).items()}
    rank = config.max_lora_rank or max([DEFAULT_MAX_RANK] + [a.rank for a in adapters.values()])
    linears = attach_lora_slots(model, config.max_loras, rank, dtype, tuple(config.lora_target_modules))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    manager = LoraManager(linears, config.max_loras, rank, dtype, device, kernels=kernels, num_sms=num_sms,
                          load_delay_s=config.lora_debug_load_delay_s)
    for name, adapter in adapters.items():
        manager.register(name, adapter)
    slot_bytes = sum(w.nbytes for w in linears.values())
    say(f"LoRA: {config.max_loras} slots of rank {rank} ({slot_bytes / 2**20:.0f} MiB), "
        f"{len(adapters)} adapter(s) loaded: {', '.join(adapters) or 'none'}")
    return manager, LoraGraphSpec(manager.num_slots, kernels, num_sms)
