"""EngineConfig.speculative specs: parse one, and build its drafter."""

from __future__ import annotations

from prefixrt.speculative.drafter import Drafter
from prefixrt.speculative.fixed_rate import FixedRateDrafter
from prefixrt.speculative.ngram import NgramDrafter

SPEC_FORMS = ("ngram", "fixed:P[:SEED]", "draft:MODEL")


def parse_spec(spec: str) -> tuple[str, dict]:
    """Validate an EngineConfig.speculative spec: "ngram", "fixed:P" / "fixed:P:SEED" (the test drafter, P in
    [0, 1]), or "draft:MODEL" (a draft model: a registry name or a folder; the engine builds it). Returns
    (kind, options); raises ValueError."""
    if isinstance(spec, str) and spec.startswith("draft:") and spec[len("draft:"):].strip():
        return "draft", {"model": spec[len("draft:"):].strip()}
    parts = str(spec).split(":")
    if parts == ["ngram"]:
        return "ngram", {}
    if parts[0] == "fixed" and len(parts) in (2, 3):
        try:
            p = float(parts[1])
            seed = int(parts[2]) if len(parts) == 3 else 0
        except ValueError:
            p, seed = -1.0, 0
        if 0.0 <= p <= 1.0:
            return "fixed", {"p": p, "seed": seed}
    raise ValueError(f"speculative must be one of {SPEC_FORMS}, got {spec!r}")


def make_drafter(spec: str, vocab_size: int) -> Drafter:
    """The host-side drafters; a "draft:MODEL" spec needs the engine's model runner (engine/loop/draft_model.py)."""
    kind, opts = parse_spec(spec)
    if kind == "draft":
        raise ValueError("a draft-model drafter is built by the engine (engine/loop/draft_model.py)")
    if kind == "ngram":
        return NgramDrafter()
    return FixedRateDrafter(opts["p"], vocab_size, seed=opts["seed"])
