"""The records of one loop step: Step (a launched forward and what the host needs to finish it), its StepFence
(when the device is done with it), and HostSample (a step's samples drawn row by row on the host).

engine/loop/core.py creates and finishes them; KVManager.write_fence holds the fence of the latest built step
(cache/kv_manager.py waits on it before a slot is reused).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from prefixrt.engine.loop.scheduler import ScheduledBatch
from prefixrt.model.forward_batch import ForwardBatch
from prefixrt.request import Req
from prefixrt.sampling.sampler import DeviceSample, SampleOutput


class StepFence:
    """Passes when the device has finished a step (its forward and sample). CUDA: an event recorded after the
    sample; CPU: marked when the step is processed. Unrecorded: pending."""

    def __init__(self, device: torch.device):
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.recorded = False
        self.done = False

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        self.recorded = True

    def query(self) -> bool:
        if not self.done and self.recorded and self.event is not None and self.event.query():
            self.done = True
        return self.done

    def wait(self) -> None:
        if not self.done:
            assert self.recorded, "waiting on a step that was never launched to the end"
            if self.event is not None:
                self.event.synchronize()
            self.done = True


@dataclass
class HostSample:
    """A step's samples already on the host (the row-by-row fallback): DeviceSample's interface."""

    token_ids: torch.Tensor  # [B] int64 on the device, for the next step's unresolved inputs
    out: SampleOutput

    def read(self) -> SampleOutput:
        return self.out


@dataclass
class Step:
    """One launched forward and what the host needs to finish it."""

    batch: ScheduledBatch
    rows: list[int | None]  # each batch request's table row at launch (a retracted one has another later)
    sampled: list[Req]  # requests with a sampled row, in row order
    epochs: list[int]  # their Req.epoch at launch: a later change marks the row stale
    fence: StepFence
    logits: torch.Tensor | None = None  # [len(sampled), V] until drawn
    result: DeviceSample | HostSample | None = None
    live: list[bool] = field(default_factory=list)  # rows sampled for real (not stale, not finished)
    fb: ForwardBatch | None = None  # built, until launched
    holes: list[int] = field(default_factory=list)  # flat positions of fb whose token is prev's device token
    hole_idx: torch.Tensor | None = None  # [2, len(holes)]: those positions, and the rows of prev's tokens
    scored: list = field(default_factory=list)  # (request, positions) wanting prompt logprobs
    num_ends: int = 0  # logits rows of sampled requests (the scored rows follow)
    spec: list = field(default_factory=list)  # speculating rows: (request, drafts, first row of spec_logits, epoch)
    spec_logits: torch.Tensor | None = None  # [sum(len(drafts) + 1), V]: their logits at every fed position
    masks: Any = None  # the step's MaskFill (grammar_masks.py; prepare_sample, rows may start during the previous process)

