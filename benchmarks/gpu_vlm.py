"""Image caching on a LLaVA-1.5-7B-shaped model (dummy bf16 weights, one H200): 64 questions over 8 images,
all submitted together, with image caching (radix keys carry each image's content hash; the encoder-output
cache) against without (radix_cache=False: every request prefills its image tokens and runs the vision tower).

The model folder is generated here (config.json: Llama-2-7B text model, CLIP ViT-L/14-336 tower, 576 image tokens;
preprocessor_config.json: CLIP's processor at 336; a small byte-level tokenizer with a plain chat template), so
nothing is downloaded. Each request: one 336x336 image + a short question, 32 new tokens (ignore_eos).
Reports wall time, requests/s, output tokens/s, prompt tokens reused and vision-tower runs per mode (median of
--repeats runs after a warm-up), then a short table; writes JSON to benchmarks/results/gpu_vlm.json.

    PYTHONPATH=$PWD python benchmarks/gpu_vlm.py            # on the GPU host (about 2 minutes)
    PYTHONPATH=$PWD python benchmarks/gpu_vlm.py --smoke    # tiny shapes on the CPU, to test the script
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, script_parser

QUESTIONS = [
    "What is in the picture?", "What colour dominates the image?", "How many objects can you see?",
    "Describe the scene in one sentence.", "Is this photo taken indoors?", "What is on the left side?",
    "What time of day is it?", "Which object is the largest?",
]
CORPUS = " ".join(QUESTIONS) * 8 + " The quick brown fox jumps over the lazy dog. Answer: "


def write_model(folder: Path, smoke: bool) -> Path:
    """A LLaVA config folder (no weights: load_format=dummy) with its image processor and a tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if smoke:
        text = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
                              eos_token_id=2, bos_token_id=1)
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                     num_hidden_layers=3, image_size=56, patch_size=14, projection_dim=16)
        image_token, size = 500, 56
    else:  # llava-hf/llava-1.5-7b-hf's shapes
        text = tf.LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                              num_key_value_heads=32, num_hidden_layers=32, max_position_embeddings=4096,
                              rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1)
        vision = tf.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                     num_hidden_layers=24, image_size=336, patch_size=14, projection_dim=768)
        image_token, size = 32000, 336
    config = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token,
                            vision_feature_layer=-2, vision_feature_select_strategy="default",
                            projector_hidden_act="gelu", eos_token_id=2)
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(folder)
    tf.CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}
                             ).save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    fast.save_pretrained(folder)
    return folder


def images(n: int, size: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def workload(pictures, questions: int, seed: int) -> list[list[dict]]:
    """questions per image, interleaved (image i's questions are spread over the batch)."""
    import random

    prompts = [[{"role": "user", "content": [{"type": "image", "image": im},
                                             {"type": "text", "text": QUESTIONS[q % len(QUESTIONS)]}]}]
               for im in pictures for q in range(questions)]
    random.Random(seed).shuffle(prompts)
    return prompts


def run_once(eng, prompts, max_new: int) -> dict:
    model = eng.probes.model
    runs0 = model.vision_runs
    t0 = time.perf_counter()
    outs = eng.generate(prompts, {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True})
    wall = time.perf_counter() - t0
    out_tokens = sum(o.completion_tokens for o in outs)
    return {
        "wall_s": wall, "requests_per_s": len(prompts) / wall, "output_tokens_per_s": out_tokens / wall,
        "prompt_tokens": sum(o.prompt_tokens for o in outs), "cached_tokens": sum(o.cached_tokens for o in outs),
        "vision_tower_runs": model.vision_runs - runs0,
    }


def bench(folder: Path, cached: bool, args, device_kw: dict) -> dict:
    import torch

    import prefixrt

    eng = prefixrt.Engine(str(folder), load_format="dummy", radix_cache=cached, **device_kw)
    try:
        size = eng.probes.model.vision_tower.config.image_size
        warm = workload(images(2, size, seed=99), 2, seed=1)
        run_once(eng, warm, args.max_new_tokens)  # kernels compiled, graphs warm
        runs = []
        for r in range(args.repeats):
            prompts = workload(images(args.images, size, seed=10 + r), args.questions, seed=r)  # new images
            runs.append(run_once(eng, prompts, args.max_new_tokens))
            log(f"  {'cached' if cached else 'uncached'} run {r}: {runs[-1]}")
        best = sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]
        return {"median": best, "runs": runs}
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    ap = script_parser(__doc__, smoke="tiny LLaVA on the CPU (fp32, torch attention), 4 images x 2 questions")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--questions", type=int, default=8, help="questions per image")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="the JSON's path (default benchmarks/results/gpu_vlm.json; a --smoke "
                    "run writes one only when asked)")
    args = ap.parse_args()
    if args.smoke:
        args.images, args.questions, args.max_new_tokens, args.repeats = 4, 2, 4, 1
        device_kw = dict(device="cpu", dtype="float32", attention_backend="torch", kv_cache_tokens=8192)
    else:
        device_kw = dict(dtype="bfloat16", kv_cache_tokens=100_000)
    results: dict = {"images": args.images, "questions_per_image": args.questions,
                     "max_new_tokens": args.max_new_tokens, "smoke": args.smoke}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp), args.smoke)
        for cached in (True, False):
            log(f"image caching {'on' if cached else 'off'}")
            results["cached" if cached else "uncached"] = bench(folder, cached, args, device_kw)
    on, off = results["cached"]["median"], results["uncached"]["median"]
    results["speedup"] = off["wall_s"] / on["wall_s"]
    out = args.out or (None if args.smoke else "benchmarks/results/gpu_vlm.json")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2))
    log(f"\nLLaVA{'(tiny, CPU)' if args.smoke else '-1.5-7B shape, dummy bf16'}: "
        f"{args.images * args.questions} questions over {args.images} images, {args.max_new_tokens} new tokens each")
    log(f"{'mode':<10}{'wall s':>9}{'req/s':>9}{'out tok/s':>11}{'cached tok':>12}{'vision runs':>13}")
    for name, r in (("cached", on), ("uncached", off)):
        log(f"{name:<10}{r['wall_s']:>9.2f}{r['requests_per_s']:>9.1f}{r['output_tokens_per_s']:>11.0f}"
            f"{r['cached_tokens']:>12}{r['vision_tower_runs']:>13}")
    log(f"speedup (wall, uncached / cached): {results['speedup']:.2f}x   (median of {args.repeats}; "
        f"JSON: {out})")


if __name__ == "__main__":
    main()
