#!/usr/bin/env python3
"""The Qwen2-VL vision tower: iris against transformers on the same weights, same machine, same run.

No registry package ships a real Qwen2-VL checkpoint, so this builds one shaped like
Qwen2-VL-2B-Instruct's vision tower (32 blocks, width 1280, 16 heads, MLP 5120, quick_gelu,
merger to 1536) with random weights (seed 0, initializer_range 0.02), stored as bf16 and run in
float32 by both engines. The language model is a 1-layer stub of width 1536 (the merger's output
width) with the tiny fixture's tokenizer: only the tower is measured. The checkpoint is cached
under --cache and reused.

Per image size (square, a multiple of 28 so neither processor resizes it):
  transformers  model.model.visual(pixel_values, grid_thw) under inference_mode, median of
                --repeats after one warm-up (torch threads: all cores)
  iris          `iris bench --image-size SxS --json`: vision_ms_per_image (the tower alone,
                median of --repeats after one warm-up) and the image prompt's TTFT

Usage: python scripts/vision_bench.py [--iris target/release/iris] [--sizes 448,896] [--repeats 3]
(needs torch and transformers>=5.20; ~1.4 GB of disk for the checkpoint, ~6 GB of memory)
Prints a markdown table and, last, one JSON line with every number.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests/fixtures/tiny-qwen2-vl"

# Qwen2-VL-2B-Instruct's vision_config (its text model is 1536 wide).
VISION_2B = dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, hidden_act="quick_gelu",
                 in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)


def make_checkpoint(out: Path) -> None:
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["vision_config"].update(VISION_2B, initializer_range=0.02)
    cfg["text_config"].update(hidden_size=1536, num_hidden_layers=1, layer_types=["full_attention"],
                              intermediate_size=256, num_attention_heads=12, num_key_value_heads=2,
                              initializer_range=0.02)
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [16, 24, 24]
    config = Qwen2VLConfig.from_dict(cfg)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:
        shutil.copy(TINY / f, tmp / f)
    pre = json.loads((TINY / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}  # Qwen2-VL-2B's bounds
    (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    tmp.rename(out)


def load_transformers(ckpt: Path):
    model = Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model.model.visual


def bench_transformers(visual, size: int, repeats: int) -> float:
    g = size // 14
    torch.manual_seed(1)
    pixels = torch.randn(g * g, 3 * 2 * 14 * 14)
    grid = torch.tensor([[1, g, g]])
    times = []
    with torch.inference_mode():
        visual(pixels, grid_thw=grid)  # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            visual(pixels, grid_thw=grid)
            times.append((time.perf_counter() - t) * 1e3)
    print(f"transformers {size}x{size}: {[round(x) for x in times]} ms", file=sys.stderr, flush=True)
    return statistics.median(times)


def bench_iris(iris: str, ckpt: Path, size: int, repeats: int) -> dict:
    cmd = [iris, "bench", "--model", str(ckpt), "--batch-sizes", "1", "--prompt-len", "8", "--gen-len", "2",
           "--repeats", str(repeats), "--image-size", f"{size}x{size}", "--json"]
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    out = json.loads(res[res.index("{"):])["image"]
    print(f"iris {size}x{size}: {out}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iris", default=str(ROOT / "target/release/iris"))
    ap.add_argument("--sizes", default="448,896")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(ROOT / ".cache/vision-bench"))
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    assert all(s % 28 == 0 for s in sizes), "sizes must be multiples of 28"
    ckpt = Path(a.cache) / "qwen2-vl-2b-vision-random"
    if not ckpt.exists():
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        make_checkpoint(ckpt)
    load_before = os.getloadavg()[0]
    # One size at a time, transformers then iris, so both see the same machine.
    visual = load_transformers(ckpt)
    hf, ir = {}, {}
    for s in sizes:
        hf[s] = bench_transformers(visual, s, a.repeats)
        ir[s] = bench_iris(a.iris, ckpt, s, a.repeats)
    load_after = os.getloadavg()[0]
    print(f"\n{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
          f"{transformers.__version__}; load average {load_before:.1f} before, {load_after:.1f} after\n")
    print("| image | patches | image tokens | transformers ms | iris ms | iris images/s | iris / transformers "
          "| iris image-prompt TTFT ms |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for s in sizes:
        i = ir[s]
        rows.append({"size": s, "patches": (s // 14) ** 2, "image_tokens": i["image_tokens"],
                     "transformers_ms": hf[s], "iris_ms": i["vision_ms_per_image"], "iris_ttft_ms": i["ttft_ms"]})
        r = rows[-1]
        print(f"| {s}x{s} | {r['patches']} | {r['image_tokens']} | {r['transformers_ms']:.0f} | {r['iris_ms']:.0f} "
              f"| {1e3 / r['iris_ms']:.3f} | {r['iris_ms'] / r['transformers_ms']:.2f} | {r['iris_ttft_ms']:.0f} |")
    print(json.dumps({"cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
                      "load": [load_before, load_after], "rows": rows}))


if __name__ == "__main__":
    main()
