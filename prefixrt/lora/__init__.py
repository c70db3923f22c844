"""Many LoRA adapters over one base model: PEFT folders read and checked (peft_format.py), registered by name
(registry.py), paged into GPU slots with an LRU (slots.py) and served by the engine through one manager
(manager.py, built at start-up by build.py). The network's side is model/lora.py; the kernels are kernels/lora.py."""
