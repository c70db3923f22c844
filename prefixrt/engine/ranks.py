"""The builder's rank strategy: how many devices the model runs on, and what that changes in building the engine.

    SingleDevice            one device: the engine is rank 0 of 1 (here)
    TensorParallelRanks     tp_size ranks, this process rank 0 (parallel/tp_worker.py, imported only then)

Both have the same methods, which builder.py calls in this order (each is a no-op or the plain step on one
device):
    start(config, model_path, say)   the device(s); tensor parallelism: the other ranks started, the rendezvous
    load_model(path, config, dtype, calibration_ids)  this rank's weights (its shard with tensor parallelism);
                                     calibration_ids: FP8 smoothing's calibration text as token ids
    agree_num_slots(n)               the KV pool size every rank can hold
    send_setup(slots, rows, cols, max_running)    what the other ranks build their pool and table from
    make_runner(config, model, pool, max_running, startup, say, table)     rank 0's model runner
    on_capture_failure(error)        may CUDA graph capture be retried with fewer graphs? (raises if not)
    stop(runner)                     at shutdown, after the loop: the other ranks return
`size` is the number of ranks; `device` rank 0's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixrt.config.engine_config import EngineConfig
from prefixrt.model import rank_setup


@dataclass
class SingleDevice:
    device: torch.device
    size: int = 1

    @classmethod
    def start(cls, config: EngineConfig, model_path=None, say=None) -> SingleDevice:
        return cls(rank_setup.resolve_device(config.device))

    def load_model(self, path, config: EngineConfig, dtype: torch.dtype, calibration_ids=None):
        from prefixrt.hub.loader import load_model

        return load_model(path, load_format=config.load_format, dtype=dtype, device=self.device,
                          quantization=config.quantization, fp8_smoothing=config.fp8_smoothing_alpha,
                          calibration_ids=calibration_ids)

    def agree_num_slots(self, num_slots: int) -> int:
        return num_slots

    def send_setup(self, num_slots: int, table_rows: int, table_cols: int, max_running: int) -> None:
        pass

    def make_runner(self, config: EngineConfig, model, pool, max_running: int, startup=None, say=None, table=None):
        return rank_setup.make_runner(config, model, pool, self.device, max_running, startup, say)

    def on_capture_failure(self, error: Exception) -> None:
        pass  # the builder retries with plain decode graphs, then runs eagerly

    def stop(self, runner=None) -> None:
        pass


def start_ranks(config: EngineConfig, model_path=None, say=None):
    """The rank strategy for config (tp_size), started: SingleDevice or parallel/'s TensorParallelRanks."""
    if config.tp_size > 1:
        from prefixrt.parallel.tp_worker import TensorParallelRanks

        return TensorParallelRanks.start(config, model_path, say)
    return SingleDevice.start(config, model_path, say)
