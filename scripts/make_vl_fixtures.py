#!/usr/bin/env python3
"""Vision-language test fixtures with Hugging Face `transformers` as the oracle (fully offline).

Writes tests/fixtures/tiny-qwen2-vl/ and tests/fixtures/tiny-qwen2.5-vl/: tiny randomly
initialised Qwen2-VL / Qwen2.5-VL checkpoints (weights stored as bf16 to keep the files small;
every reference is computed in float32 from the checkpoint *as reloaded from disk*), a tiny
byte-level BPE tokenizer (trained by make_fixtures.py's code) with the Qwen-VL special tokens,
the Qwen2-VL chat template, preprocessor_config.json, the test images, and references.

The two checkpoints cover both on-disk layouts real checkpoints use:
  tiny-qwen2-vl     config.json as transformers 5 saves it (nested text_config / vision_config),
                    weights as save_pretrained writes them (model.layers.*, visual.*), tied
                    embeddings (like Qwen2-VL-2B), preprocessor_config.json with
                    size.{shortest,longest}_edge.
  tiny-qwen2.5-vl   config.json in the flat hub form of the released checkpoints (text fields at
                    the top, rope_scaling {"type": "mrope"}), weights renamed to
                    model.language_model.* / model.visual.*, untied lm_head, windowed vision
                    attention (window_size 56 -> 2x2 merged tokens per window) with
                    fullatt_block_indexes [1], preprocessor_config.json with min_pixels/max_pixels.

Images are processed by the PIL backend (Qwen2VLImageProcessorPil, loaded from the saved
preprocessor_config.json): PIL bicubic resize of uint8 RGB, rescale, normalize. The torchvision
backend (what AutoProcessor picks when torchvision is installed) resizes differently; its
max difference is recorded in reference.json.

reference.safetensors, per case `{single,multi,nonsquare,text}` (float32 / int64, no batch dim):
  CASE.input_ids [T]          prompt after the processor expanded each <|image_pad|>
  CASE.pixel_values_t0 [P, C*14*14]  pixel_values [P, C*2*14*14] without the temporal repeat
                              (each row is [C, T=2, 14, 14] with T=1 == T=0: T=0 kept)
  CASE.image_grid_thw [N,3]   (image cases)
  CASE.position_ids [3, T]    HF get_rope_index (M-RoPE t/h/w) ; CASE.rope_delta [1]
  CASE.image_embeds [N_img_tokens, H]   vision tower + merger output (image cases)
  CASE.embed [T,H]            input of decoder layer 0 (image embeddings merged in)
  CASE.layer.{i} [T,H]        output of decoder layer i
  CASE.final_norm [T,H], CASE.logits_tail [4,V] (logits of the last 4 rows)
  CASE.generated_ids [10]     greedy, EOS ignored; equal to an argmax loop re-running the full
                              forward (checked, see reference.json checks)
reference.json: messages / prompts, image files, sizes, special ids, checks, versions.

Needs torch, transformers>=5.20 (generated with 5.24.0), tokenizers, safetensors, numpy, pillow
and torchvision (the processor class insists on a video processor).
Usage: python scripts/make_vl_fixtures.py [--out tests/fixtures] [--models qwen2_vl,qwen2_5_vl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (sets the offline env vars, trains tokenizers)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import transformers  # noqa: E402
from transformers import AddedToken, AutoModelForImageTextToText  # noqa: E402

MODEL_VOCAB = 512
MAX_NEW_TOKENS = 10
LOGIT_ROWS = 4
MIN_MARGIN = 2e-3  # greedy references must not hinge on near-ties
MIN_PIXELS, MAX_PIXELS = 56 * 56, 84 * 84
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL-Instruct's chat template (image/video placeholders; plain string content too)
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Images: (file, height, width). Sizes chosen to hit every smart_resize branch with
# min_pixels 56*56 and max_pixels 84*84: as is (56x56), Python's round-half-to-even
# (70 / 28 = 2.5 -> 2), downscale by floor (120x72 -> 84x56), upscale by ceil (20x30 -> 56x84).
IMAGES = {
    "square": ("image_square.png", 56, 56),
    "round_half": ("image_70x90.png", 70, 90),
    "large": ("image_120x72.png", 120, 72),
    "small": ("image_20x30.png", 20, 30),
}
CASES = {
    "single": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}],
    "nonsquare": [{"role": "user", "content": [{"type": "text", "text": "What is shown in the picture?"},
                                               {"type": "image"}]}],
    # two images across two turns, with an assistant answer between them
    "multi": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]},
        {"role": "assistant", "content": "There is a red square on a blue background."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
    ],
}
CASE_IMAGES = {"single": ["square"], "nonsquare": ["round_half"], "multi": ["large", "small"]}
TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. Numbers: 42, 1024; café"


def make_image(name: str, seed: int) -> Image.Image:
    """Smooth gradients plus noise (so the bicubic filter sees both edges and slopes)."""
    _, h, w = IMAGES[name]
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    base = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 127 + 100 * np.sin((x + y) / 5)], -1)
    img = np.clip(base + rng.normal(0, 12, size=(h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(img, mode="RGB")


def make_tokenizer():
    from transformers import Qwen2Tokenizer
    from tokenizers import Regex, normalizers, pre_tokenizers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(mf.QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe = mf.train_bytelevel_bpe(pre, normalizers.NFC(), MODEL_VOCAB - 64, [])
    vocab, merges = mf.vocab_and_merges(bpe)
    n = len(vocab)
    vocab = dict(vocab, **{t: n + i for i, t in enumerate(QWEN_SPECIALS)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, bos_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token=None)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS], special_tokens=True)
    tok.chat_template = QWEN_VL_CHAT_TEMPLATE
    return tok


def text_config(ids, init_std):
    return dict(
        vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=4096,
        rms_norm_eps=1e-6, initializer_range=init_std,
        # head_dim 16 -> 8 rotary frequencies split over (t, h, w)
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
    )


def build(name, init_std):
    from transformers import (Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLImageProcessorPil, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)
    tok = make_tokenizer()
    ids = tok.convert_tokens_to_ids
    special = dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                   vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    if name == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, hidden_act="quick_gelu",
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                      initializer_range=init_std)
        cfg = Qwen2VLConfig(text_config=text_config(ids, init_std), vision_config=vision, tie_word_embeddings=True,
                            **special)
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, hidden_act="silu",
                      out_hidden_size=64, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                      initializer_range=init_std)
        cfg = Qwen2_5_VLConfig(text_config=text_config(ids, init_std), vision_config=vision,
                               tie_word_embeddings=False, **special)
    ip = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                  size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    vp = Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    proc = Qwen2VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=QWEN_VL_CHAT_TEMPLATE)
    return cfg, proc


def flat_hub_config(path):
    """Rewrite a v5 nested config.json into the flat form of the released Qwen2.5-VL checkpoints."""
    with open(path) as fh:
        c = json.load(fh)
    text = c.pop("text_config")
    rope = text.pop("rope_parameters")
    for k in ("model_type", "dtype", "architectures"):
        text.pop(k, None)
    out = {"architectures": c.pop("architectures"), "model_type": c.pop("model_type")}
    out.update(text)
    out["rope_theta"] = rope["rope_theta"]
    out["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    out.update(c)
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2, sort_keys=True)
        fh.write("\n")


def relayout_weights(path):
    """model.layers.* / visual.* -> model.language_model.* / model.visual.* (the v5 module names)."""
    t = load_file(path)
    out = {}
    for k, v in t.items():
        if k.startswith("visual."):
            k = "model." + k
        elif k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        out[k] = v
    save_file(out, path, metadata={"format": "pt"})


def classic_preprocessor_config(path):
    """min_pixels / max_pixels keys, as the released checkpoints' preprocessor_config.json."""
    with open(path) as fh:
        c = json.load(fh)
    size = c.pop("size")
    c["min_pixels"], c["max_pixels"] = size["shortest_edge"], size["longest_edge"]
    c["image_processor_type"] = "Qwen2VLImageProcessor"
    with open(path, "w") as fh:
        json.dump(c, fh, indent=2, sort_keys=True)
        fh.write("\n")


def capture(model, inputs):
    """Embeddings after merging, each decoder layer's output, final norm, logits (batch squeezed)."""
    lm = model.model.language_model
    captured = {}
    handles = [lm.layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: captured.__setitem__("embed", (args[0] if args else kwargs["hidden_states"])[0]
                                                       .detach().float().clone()), with_kwargs=True)]
    for i, layer in enumerate(lm.layers):
        def hook(mod, args, out, i=i):
            h = out[0] if isinstance(out, (tuple, list)) else out
            captured[f"layer.{i}"] = h[0].detach().float().clone()
        handles.append(layer.register_forward_hook(hook))
    handles.append(lm.norm.register_forward_hook(
        lambda mod, args, out: captured.__setitem__("final_norm", out[0].detach().float().clone())))
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    for h in handles:
        h.remove()
    captured["logits"] = logits
    return captured


class Unsuitable(Exception):
    """A random draw whose greedy reference would be fragile (near-tie, or it emits an image pad)."""


def greedy(model, inputs, n, image_token_id):
    """generate() (EOS ignored) and an argmax loop re-running the whole forward each step."""
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                          pad_token_id=model.config.text_config.pad_token_id, bos_token_id=None)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(**inputs, generation_config=gc)
    finally:
        model.generation_config.eos_token_id = saved
    gen = out[0, inputs["input_ids"].shape[1]:]
    seq = dict(inputs)
    margins = []
    manual = []
    for _ in range(n):
        with torch.no_grad():
            last = model(**seq).logits[0, -1].float()
        top2 = last.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        nxt = last.argmax()
        manual.append(int(nxt))
        if int(nxt) == image_token_id:
            raise Unsuitable("generates an image pad token")
        seq["input_ids"] = torch.cat([seq["input_ids"], nxt.view(1, 1)], dim=1)
        seq["attention_mask"] = torch.ones_like(seq["input_ids"])
        if "mm_token_type_ids" in seq:
            seq["mm_token_type_ids"] = torch.cat([seq["mm_token_type_ids"], torch.zeros((1, 1), dtype=seq[
                "mm_token_type_ids"].dtype)], dim=1)
    return gen, {"generate_equals_full_forward_argmax_loop": gen.tolist() == manual,
                 "min_top1_top2_margin_generation": round(min(margins), 6)}


def build_one(name, out_root, seed, init_std, perturb):
    torch.manual_seed(seed)
    cfg, proc = build(name, init_std)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    mf.perturb_(model, perturb, torch.Generator().manual_seed(seed + 1))
    model = model.to(torch.bfloat16).eval()
    out_dir = os.path.join(out_root, "tiny-" + name.replace("qwen2_vl", "qwen2-vl").replace("qwen2_5_vl", "qwen2.5-vl"))
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, f))
    model.save_pretrained(out_dir)
    proc.tokenizer.save_pretrained(out_dir)
    proc.image_processor.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as fh:
        fh.write(QWEN_VL_CHAT_TEMPLATE)
    if name == "qwen2_5_vl":
        flat_hub_config(os.path.join(out_dir, "config.json"))
        relayout_weights(os.path.join(out_dir, "model.safetensors"))
        classic_preprocessor_config(os.path.join(out_dir, "preprocessor_config.json"))

    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor, Qwen2VLVideoProcessor
    tok = AutoTokenizer.from_pretrained(out_dir)
    ip = Qwen2VLImageProcessorPil.from_pretrained(out_dir)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"]) == (MIN_PIXELS, MAX_PIXELS), ip.size
    proc = Qwen2VLProcessor(image_processor=ip, tokenizer=tok,
                            video_processor=Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2),
                            chat_template=QWEN_VL_CHAT_TEMPLATE)
    ref = AutoModelForImageTextToText.from_pretrained(out_dir, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    # every parameter came from the file (a layout transformers did not recognise would leave
    # randomly initialised weights behind instead)
    saved = {k: v.float() for k, v in model.state_dict().items()}
    loaded = ref.state_dict()
    assert set(saved) == set(loaded), set(saved) ^ set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved if "inv_freq" not in k)
    images = {}
    for key, (fname, _, _) in IMAGES.items():
        images[key] = make_image(key, seed + 10 + list(IMAGES).index(key))
        images[key].save(os.path.join(out_dir, fname))
        images[key] = Image.open(os.path.join(out_dir, fname))  # what a reader of the file sees

    try:
        from transformers import Qwen2VLImageProcessor  # torchvision backend
        tv = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                   size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    except Exception:  # noqa: BLE001
        tv = None

    tensors, cases, checks = {}, {}, {}
    for case, msgs in list(CASES.items()) + [("text", None)]:
        if msgs is None:
            inputs = dict(tok([TEXT_PROMPT], return_tensors="pt"))
            prompt, imgs = TEXT_PROMPT, []
        else:
            prompt = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            imgs = [images[k] for k in CASE_IMAGES[case]]
            inputs = dict(proc(text=[prompt], images=imgs, return_tensors="pt"))
        t = {"input_ids": inputs["input_ids"][0]}
        if imgs:
            pix = inputs["pixel_values"].float()
            # rows are [C, T=2, 14, 14] with the frame repeated over T: keep T=0 only (half the bytes)
            assert torch.equal(pix.view(-1, 3, 2, 196)[:, :, 0], pix.view(-1, 3, 2, 196)[:, :, 1])
            t["pixel_values_t0"] = pix.view(-1, 3, 2, 196)[:, :, 0].reshape(pix.shape[0], -1)
            t["image_grid_thw"] = inputs["image_grid_thw"]
            with torch.no_grad():
                pos, delta = ref.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                      image_grid_thw=inputs["image_grid_thw"],
                                                      attention_mask=inputs["attention_mask"])
                feats = ref.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            t["position_ids"] = pos[:, 0]
            t["rope_delta"] = delta.view(1)
            t["image_embeds"] = torch.cat(list(feats.pooler_output), 0).float()
            if tv is not None:
                tv_pix = tv(images=imgs, return_tensors="pt")["pixel_values"]
                checks[f"{case}.torchvision_backend_pixel_values_max_abs_diff"] = float(
                    (tv_pix - pix).abs().max())
        cap = capture(ref, inputs)
        for k, v in cap.items():
            t[k] = v
        # logits of the last rows only (the full [T, 512] tables would dominate the fixture size)
        t["logits_tail"] = t.pop("logits")[-LOGIT_ROWS:]
        gen, gcheck = greedy(ref, inputs, MAX_NEW_TOKENS, proc.image_token_id)
        if not gcheck["generate_equals_full_forward_argmax_loop"] or \
                gcheck["min_top1_top2_margin_generation"] < MIN_MARGIN:
            raise Unsuitable(f"{name} seed {seed} {case}: {gcheck}")
        t["generated_ids"] = gen
        checks[case] = gcheck
        for k, v in t.items():
            tensors[f"{case}.{k}"] = v.contiguous()
        cases[case] = {"messages": msgs, "prompt": prompt, "images": [IMAGES[k][0] for k in CASE_IMAGES.get(case, [])],
                       "input_ids": t["input_ids"].tolist(), "generated_ids": gen.tolist(),
                       "image_grid_thw": t["image_grid_thw"].tolist() if imgs else []}
        print(f"{name} {case}: T={t['input_ids'].shape[0]} gen={gen.tolist()} {gcheck}", flush=True)

    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"generator": f"scripts/make_vl_fixtures.py transformers={transformers.__version__}"})
    info = {
        "model_type": cfg.model_type,
        "num_layers": cfg.text_config.num_hidden_layers,
        "cases": cases,
        "text_prompt": TEXT_PROMPT,
        "images": {k: {"file": f, "height": h, "width": w} for k, (f, h, w) in IMAGES.items()},
        "image_processor_backend": "PIL (Qwen2VLImageProcessorPil, bicubic)",
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS},
        "max_new_tokens": MAX_NEW_TOKENS,
        "seed": seed, "init_std": init_std, "perturb": perturb,
        "n_params": int(sum(p.numel() for p in model.parameters())),
        "checks": checks,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "keys": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(tensors.items())},
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as fh:
        json.dump(info, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))}
    print(name, sizes, checks, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(mf.REPO, "tests", "fixtures"))
    ap.add_argument("--models", default="qwen2_vl,qwen2_5_vl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.2)
    ap.add_argument("--perturb", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    for name in args.models.split(","):
        # the first seed (from --seed on) whose greedy references are robust
        for seed in range(args.seed, args.seed + 20):
            try:
                build_one(name.strip(), args.out, seed, args.init_std, args.perturb)
                break
            except Unsuitable as e:
                print("retrying with the next seed:", e, flush=True)


if __name__ == "__main__":
    main()
