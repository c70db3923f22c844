"""The weights' FP8 form at start-up, before any kernel plan is made: the calibration text quantize-at-load smooths
with (model/smoothing.py), quantize-at-load for a model the builder did not load (build's loader quantizes the
checkpoints it loads), the activation scheme of inputs taller than a decode batch, and on CUDA the FP8 speed check,
which may fall back to bf16 weights. engine/builder.py calls both functions; the disk tier's K/V identity records
what prepare_weights returns.
"""

from __future__ import annotations

from prefixrt.config.engine_config import EngineConfig
from prefixrt.stage_clock import StageClock


def fp8_calibration_ids(config: EngineConfig, tokenizer) -> list[int] | None:
    """The calibration text as token ids when quantize-at-load smooths (model/smoothing.py), else None."""
    if config.quantization != "fp8" or config.fp8_smoothing_alpha is None:
        return None
    from prefixrt.model.kv_calibration import calibration_tokens

    return calibration_tokens(tokenizer)


def prepare_weights(config: EngineConfig, model, tokenizer, dtype, startup: dict, clock: StageClock,
                    say) -> bool | None:
    """FP8 weights and their activation scheme, before any kernel plan is made (build's loader already quantized
    a float checkpoint; an injected model is smoothed and quantized here, calibrated on the tokenizer's text), then
    on CUDA the FP8 speed check (before the pool is sized from free memory). Returns whether the model serves FP8
    weights (False after the speed check fell back to bf16; None: as config.quantization says), which the disk
    tier's K/V identity records."""
    if config.quantization == "fp8":
        from prefixrt.model.quantize import quantize_fp8_at_load

        quantize_fp8_at_load(model, config.fp8_smoothing_alpha, fp8_calibration_ids(config, tokenizer))
    from prefixrt.model.fp8_speed_check import check_fp8_speed
    from prefixrt.model.quantize import set_fp8_activation_scale

    set_fp8_activation_scale(model, config.fp8_activation_scale)
    with clock.stage("FP8 speed check"):
        speed = check_fp8_speed(model, dtype, config.fp8_speed_check, say)
    if speed is None:
        return None
    startup["fp8_speed_check"] = {"fp8_us": round(speed.fp8_us, 1), "bf16_us": round(speed.bf16_us, 1),
                                  "served_as_fp8": not speed.fp8_slower}
    return not speed.fp8_slower
