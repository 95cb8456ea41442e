#!/usr/bin/env python3
"""Qwen3.5 vision-language test fixtures with transformers as the oracle (fully offline).

Writes tests/fixtures/tiny-qwen3.5-vl/ and tests/fixtures/tiny-qwen3.5-moe-vl/: tiny random
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` checkpoints with the
tokenizer, images, cases and reference keys of make_vl_fixtures.py (whose helpers this script
uses; the MoE adds make_glm_fixtures.py's `CASE.router.{i}`), and Qwen3.5's real chat template
(tests/fixtures/templates/Qwen3.5-4B.jinja, see make_qwen35_template_fixtures.py).

Language model: make_qwen35_fixtures.py's (4 layers: 3 Gated DeltaNet, then gated attention with
partial rotary and interleaved M-RoPE sections [2, 1, 1], which images now exercise); the MoE with
hidden 32, 8 experts (top 2) and a gated shared expert.
Vision tower (both): the Qwen3.5 ViT over 16x16 patches: 3-D patch embedding with bias, a learned
5x5 position table (`num_position_embeddings` 25) that every test image's patch grid (4x4, 4x6,
6x2) resamples bilinearly (align_corners), 2 LayerNorm blocks with a plain gelu_pytorch_tanh MLP
and 2-D rotary, the LayerNorm + GELU merger; width 32, 2 heads.

Every 1-D parameter (norms, biases, A_log, dt_bias) gets N(0, 0.1) noise, so a (1+w)-vs-w bug, a
missing bias or a wrong decay changes the outputs. Weights are stored as bf16; references are
computed in f32 from the checkpoint as reloaded. A draw is kept only if transformers' own f32
hidden states are within 2e-5 (relative to each layer's largest value) of its float64 ones: a
token on which the random model is ill-conditioned (a DeltaNet head's output near zero going into
the gated norm, seen at 1e-4 with one seed) would make any f32 implementation miss the 1e-4
tolerance against an f32 reference.

  tiny-qwen3.5-vl      top-level tie_word_embeddings false while text_config says true: transformers
                       ties (or not) by the top-level config, so lm_head is its own tensor;
                       the processor as transformers 5 saves it (processor_config.json only, no
                       preprocessor_config.json)
  tiny-qwen3.5-moe-vl  tied (both levels), preprocessor_config.json with min_pixels / max_pixels
                       (the released checkpoints' form)

Images: Qwen2VLImageProcessorPil (what transformers maps qwen3_5 to) with patch 16, mean/std 0.5 and
size {shortest_edge 64*64, longest_edge 80*80}: 56x56 -> 64x64 (as is after rounding), 70x90 ->
64x96 (rounding), 120x72 -> 96x32 (the max bound), 20x30 -> 64x96 (the min bound).

Usage: /work/venv-torch/bin/python scripts/make_qwen35_vl_fixtures.py [--models dense,moe]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402
import make_glm_fixtures as glm  # noqa: E402
import make_qwen35_fixtures as q35  # noqa: E402
import make_vl_fixtures as vl  # noqa: E402

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

with open(os.path.join(mf.REPO, "tests", "fixtures", "templates", "Qwen3.5-4B.jinja")) as fh:
    TEMPLATE = fh.read()
SPECIALS = vl.QWEN_SPECIALS + ["<think>", "</think>"]
PATCH = 16
MIN_PIXELS, MAX_PIXELS = 64 * 64, 80 * 80
MAX_F32_VS_F64 = 2e-5
NAMES = {"dense": "tiny-qwen3.5-vl", "moe": "tiny-qwen3.5-moe-vl"}


def build(kind, init_std):
    from transformers import (Qwen2VLImageProcessorPil, Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLProcessor,
                              Qwen3VLVideoProcessor)
    tok = vl.make_tokenizer(SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", template=TEMPLATE)
    ids = tok.convert_tokens_to_ids
    special = dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                   vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    text = dict(q35.TEXT, vocab_size=vl.MODEL_VOCAB, initializer_range=init_std, tie_word_embeddings=True,
                bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    if kind == "moe":
        text.update(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
                    num_experts_per_tok=2)
        text.pop("intermediate_size")
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=PATCH,
                  temporal_patch_size=2, spatial_merge_size=2, in_channels=3, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=25, initializer_range=init_std)
    if kind == "dense":
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **special)
    else:
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **special)
    ip = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=2, temporal_patch_size=2,
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                  size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    vp = Qwen3VLVideoProcessor(patch_size=PATCH, merge_size=2, temporal_patch_size=2)
    proc = Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=TEMPLATE)
    return cfg, proc


def classic_preprocessor_config(path):
    """min_pixels / max_pixels keys, as the released checkpoints' preprocessor_config.json."""
    with open(path) as fh:
        c = json.load(fh)
    size = c.pop("size")
    c["min_pixels"], c["max_pixels"] = size["shortest_edge"], size["longest_edge"]
    with open(path, "w") as fh:
        json.dump(c, fh, indent=2, sort_keys=True)
        fh.write("\n")


def build_one(kind, out_root, seed, init_std, perturb):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor, Qwen3VLVideoProcessor
    torch.manual_seed(seed)
    cfg, proc = build(kind, init_std)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    mf.perturb_(model, perturb, torch.Generator().manual_seed(seed + 1))
    model = model.to(torch.bfloat16).eval()
    out_dir = os.path.join(out_root, NAMES[kind])
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, f))
    model.save_pretrained(out_dir)
    proc.tokenizer.save_pretrained(out_dir)
    if kind == "dense":
        proc.save_pretrained(out_dir)  # processor_config.json (image processor nested in it)
        for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
            if os.path.exists(os.path.join(out_dir, f)):
                os.remove(os.path.join(out_dir, f))
    else:
        proc.image_processor.save_pretrained(out_dir)
        classic_preprocessor_config(os.path.join(out_dir, "preprocessor_config.json"))
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as fh:
        fh.write(TEMPLATE)
    for f in os.listdir(out_dir):  # save_pretrained writes the weights 0600
        os.chmod(os.path.join(out_dir, f), 0o644)

    tok = AutoTokenizer.from_pretrained(out_dir)
    if kind == "dense":
        ip = Qwen3VLProcessor.from_pretrained(out_dir).image_processor
    else:
        ip = Qwen2VLImageProcessorPil.from_pretrained(out_dir)
    assert (ip.size["shortest_edge"], ip.size["longest_edge"], ip.patch_size) == (MIN_PIXELS, MAX_PIXELS, PATCH)
    assert list(ip.image_mean) == [0.5] * 3, ip.image_mean
    ip = Qwen2VLImageProcessorPil(**{k: getattr(ip, k) for k in ("patch_size", "merge_size", "temporal_patch_size",
                                                                  "image_mean", "image_std", "size")})
    proc = Qwen3VLProcessor(image_processor=ip, tokenizer=tok,
                            video_processor=Qwen3VLVideoProcessor(patch_size=PATCH, merge_size=2,
                                                                  temporal_patch_size=2),
                            chat_template=TEMPLATE)
    ref = AutoModelForImageTextToText.from_pretrained(out_dir, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    saved = {k: v.float() for k, v in model.state_dict().items()}
    loaded = ref.state_dict()
    assert set(saved) == set(loaded), set(saved) ^ set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved), [k for k in saved if not torch.equal(saved[k], loaded[k])]
    # float64 twin (eager experts: the grouped matmul has no float64 kernel) for the conditioning check
    ref64 = AutoModelForImageTextToText.from_pretrained(out_dir, dtype=torch.float64, attn_implementation="eager",
                                                        experts_implementation="eager").eval()
    lm = ref.model.language_model
    tied = ref.lm_head.weight.data_ptr() == lm.embed_tokens.weight.data_ptr()
    assert tied == (kind == "moe"), "tying follows the top-level config"
    images = {}
    for key, (fname, _, _) in vl.IMAGES.items():
        images[key] = vl.make_image(key, seed + 10 + list(vl.IMAGES).index(key))
        images[key].save(os.path.join(out_dir, fname))
        images[key] = Image.open(os.path.join(out_dir, fname))

    tensors, cases, checks = {}, {}, {}
    pd = 3 * 2 * PATCH * PATCH
    for case, msgs in list(vl.CASES.items()) + [("text", None)]:
        if msgs is None:
            inputs = dict(tok([vl.TEXT_PROMPT], return_tensors="pt"))
            prompt, imgs = vl.TEXT_PROMPT, []
        else:
            prompt = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            imgs = [images[k] for k in vl.CASE_IMAGES[case]]
            inputs = dict(proc(text=[prompt], images=imgs, return_tensors="pt"))
        t = {"input_ids": inputs["input_ids"][0]}
        if imgs:
            pix = inputs["pixel_values"].float()
            assert pix.shape[1] == pd
            half = PATCH * PATCH
            assert torch.equal(pix.view(-1, 3, 2, half)[:, :, 0], pix.view(-1, 3, 2, half)[:, :, 1])
            t["pixel_values_t0"] = pix.view(-1, 3, 2, half)[:, :, 0].reshape(pix.shape[0], -1)
            t["image_grid_thw"] = inputs["image_grid_thw"]
            with torch.no_grad():
                pos, delta = ref.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                      image_grid_thw=inputs["image_grid_thw"],
                                                      attention_mask=inputs["attention_mask"])
                feats = ref.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            t["position_ids"] = pos[:, 0]
            t["rope_delta"] = delta.view(1)
            t["image_embeds"] = torch.cat(list(feats.pooler_output), 0).float()
        t.update(vl.capture(ref, inputs))
        exact = vl.capture(ref64, {k: v.double() if k == "pixel_values" else v for k, v in inputs.items()})
        worst = max(float((t[k] - exact[k]).abs().max() / exact[k].abs().max())
                    for k in exact if k.startswith("layer.") or k == "final_norm")
        if worst > MAX_F32_VS_F64:
            raise vl.Unsuitable(f"{kind} seed {seed} {case}: f32 hidden states {worst:.2e} from float64's")
        checks[f"{case}.f32_vs_f64_hidden_max_rel"] = round(worst, 9)
        t["logits_tail"] = t.pop("logits")[-vl.LOGIT_ROWS:]
        if kind == "moe":
            t.update(glm.capture_router(ref, inputs))
        gen, gcheck = vl.greedy(ref, inputs, vl.MAX_NEW_TOKENS, proc.image_token_id)
        if not gcheck["generate_equals_full_forward_argmax_loop"] or \
                gcheck["min_top1_top2_margin_generation"] < vl.MIN_MARGIN:
            raise vl.Unsuitable(f"{kind} seed {seed} {case}: {gcheck}")
        t["generated_ids"] = gen
        checks[case] = gcheck
        for k, v in t.items():
            tensors[f"{case}.{k}"] = v.contiguous()
        cases[case] = {"messages": msgs, "prompt": prompt,
                       "images": [vl.IMAGES[k][0] for k in vl.CASE_IMAGES.get(case, [])],
                       "input_ids": t["input_ids"].tolist(), "generated_ids": gen.tolist(),
                       "image_grid_thw": t["image_grid_thw"].tolist() if imgs else []}
        print(f"{kind} {case}: T={t['input_ids'].shape[0]} gen={gen.tolist()} {gcheck}", flush=True)

    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"generator": f"scripts/make_qwen35_vl_fixtures.py transformers={transformers.__version__}"})
    tc = cfg.text_config
    n_params = int(sum(p.numel() for p in ref.parameters()))
    n_vision = int(sum(p.numel() for n, p in ref.named_parameters() if n.startswith("model.visual.")))
    active = n_params - n_vision
    if kind == "moe":
        active -= tc.num_hidden_layers * (tc.num_experts - tc.num_experts_per_tok) * 3 * tc.hidden_size \
            * tc.moe_intermediate_size
    info = {
        "model_type": cfg.model_type,
        "num_layers": tc.num_hidden_layers,
        "layer_types": list(tc.layer_types),
        "cases": cases,
        "text_prompt": vl.TEXT_PROMPT,
        "images": {k: {"file": f, "height": h, "width": w} for k, (f, h, w) in vl.IMAGES.items()},
        "image_processor_backend": "PIL (Qwen2VLImageProcessorPil, bicubic)",
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in SPECIALS},
        "max_new_tokens": vl.MAX_NEW_TOKENS,
        "seed": seed, "init_std": init_std, "perturb": perturb,
        "tied_embeddings": tied,
        # transformers' counts: the whole model (a tied lm_head once), its vision tower, and the
        # language model's parameters one token computes with
        "n_params": n_params,
        "n_vision_params": n_vision,
        "n_text_params": n_params - n_vision,
        "n_active_text_params": active,
        "checks": checks,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "keys": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(tensors.items())},
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as fh:
        json.dump(info, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    for f in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, f), 0o644)
    sizes = {f: os.path.getsize(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))}
    print(kind, sizes, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(mf.REPO, "tests", "fixtures"))
    ap.add_argument("--models", default="dense,moe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.2)
    ap.add_argument("--perturb", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    for kind in args.models.split(","):
        for seed in range(args.seed, args.seed + 20):
            try:
                build_one(kind.strip(), args.out, seed, args.init_std, args.perturb)
                break
            except vl.Unsuitable as e:
                print("retrying with the next seed:", e, flush=True)


if __name__ == "__main__":
    main()
