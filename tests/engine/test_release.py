"""builder.free_device_memory: every owner frees its own device memory (runner: CUDA graphs and attention
workspaces; KV pool; request table; weights), so nothing the engine allocated stays reachable from it.

On the CPU, where nothing else can measure it, the engine runs with the Triton backend under the interpreter and
emulated CUDA graphs (decode and EXTEND), so its workspaces and static graph batches exist; after shutdown the
owners' close() runs and a walk over everything reachable from the engine finds no tensor left but the rotary
tables' CPU copies. tests/engine/test_gpu_release.py measures the same on CUDA (allocated bytes back to the start).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from prefixrt.engine import builder

KEPT = ("_inv_freq_cpu", "_inv_freq")  # RotaryEmbedding's host table (and its device copy, dropped to it)


def _reachable_tensors(root) -> list[str]:
    """Paths of non-empty, non-meta tensors reachable through prefixrt objects, torch modules, lists, dicts."""
    found, seen = [], set()

    def walk(obj, path, depth=0):
        if id(obj) in seen or depth > 16:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel() and obj.device.type != "meta" and not path.endswith(KEPT):
                found.append(path)
            return
        if isinstance(obj, dict):
            items = [(f"[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            items = [(f"[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, torch.nn.Module):
            items = [(f".{k}", v) for k, v in vars(obj).items()]
        elif type(obj).__module__.startswith("prefixrt") and hasattr(obj, "__dict__"):
            items = [(f".{k}", v) for k, v in vars(obj).items()]
        else:
            return
        for key, value in items:
            walk(value, path + key, depth + 1)

    walk(root, "built")
    return found


def test_owners_free_every_tensor_the_engine_allocated(tiny_checkpoints, tiny_tokenizer):
    from prefixrt.engine.engine import Engine
    from prefixrt.hub.loader import load_model

    path, _ = tiny_checkpoints("llama")
    model = load_model(path, dtype="float32", device="cpu")
    resolved = SimpleNamespace(name="tiny-llama", revision="test", extra_eos_token_ids=(), path=str(path))
    eng = Engine("tiny-llama", _parts=(model, tiny_tokenizer, resolved), device="cpu", kv_cache_tokens=256,
                 attention_backend="triton", max_running_requests=4)
    try:
        table = eng.core.kv.table
        eng._run_on_loop(lambda: eng.core.runner.capture_graphs(table.table, table.alloc_row(), 4, 96,
                                                                max_extend_tokens=32, emulate=True))
        prompts = [[1, 5, 6, 7] * 5, [1, 5, 6, 8] * 5]
        out = eng.generate(prompts, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert all(len(c.token_ids) == 4 for c in out)
    finally:
        eng.shutdown()  # on the CPU, shutdown leaves the memory to the objects
    built = eng._built
    before = _reachable_tensors(built)
    assert any(".attn_backend._workspaces" in p for p in before) and any(".graphs." in p for p in before)
    assert any("._parameters" in p for p in before) and any(".k_buffers" in p for p in before)
    built.owns_model = True  # loaded here: ours to free
    builder.free_device_memory(built)
    assert _reachable_tensors(built) == []
