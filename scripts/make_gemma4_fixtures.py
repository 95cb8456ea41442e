#!/usr/bin/env python3
"""Tiny random Gemma 4 fixtures with transformers 5.24 as the oracle.

    tests/fixtures/tiny-gemma4/      Gemma4ForConditionalGeneration (`gemma4`, a `text_config` and a
                                     tiny vision tower, no audio), the VLM layout
                                     (`model.language_model.*`, `model.vision_tower.*`), E2B-like:
                                     per-layer embeddings (PLE), the last 3 of 6 layers KV-shared
                                     (sliding ones read layer 1, the full one layer 2), double-wide
                                     MLPs on the shared layers, 1 KV head; references from its
                                     language model on text only
    tests/fixtures/tiny-gemma4-moe/  Gemma4ForCausalLM (`gemma4_text`), 26B-A4B-like: an MoE block
                                     (8 experts, top 2) beside the dense MLP in every layer,
                                     K-eq-V on the full layers with their own KV-head count, no PLE
    tests/fixtures/tiny-gemma4-unified-vlm/  Gemma4UnifiedForConditionalGeneration (`gemma4_unified`):
                                     tiny-gemma4-unified's text under the VLM layout and the
                                     encoder-free vision embedder (no tower: merged pixel patches
                                     through layer norms, a dense layer and a factorized position
                                     table, patch 4 merged 2 x 2), with the image cases below
    tests/fixtures/tiny-gemma4-unified/  Gemma4UnifiedForCausalLM (`gemma4_unified_text`, the 12B
                                     family's language model): no PLE fields at all (none used),
                                     Gemma 2-style sandwich norms with `layer_scalar`, the last 2 of
                                     6 layers KV-shared, K-eq-V on the full layers,
                                     use_bidirectional_attention "vision" by default

Both: hidden 64, 4 heads; sliding layers 2 KV heads of 16 (window 8, shorter than the prompts),
full layers heads of 32 with "proportional" RoPE (partial factor 0.25: 4 of 16 angles turn, the
rest are identity); plain-w RMSNorms, q/k/v norms, attention scale 1, final logit soft-cap 30,
tied head. Every 1-D parameter gets N(0, 0.1) noise and every `layer_scalar` a value in
[0.5, 1.5], so a (1+w)-vs-w bug, a skipped scalar or a wrong router scale changes the outputs.

reference.safetensors has the keys of scripts/make_fixtures.py (text.* with per-layer hidden
states, chat.*), computed from the checkpoint as reloaded from disk. The tokenizer and chat
template are make_fixtures.py's Gemma ones.

tiny-gemma4 is also a vision-language fixture: its tokenizer gets Gemma 4's multimodal tokens at
the config's ids, processor_config.json a tower of patch 4 and pooling 2 (max_soft_tokens 70),
the chat template writes `<|image|>` for image parts, and three image cases (reference.json
"cases": single, nonsquare, multi) hold the chat prompt as transformers' processor expands it
(`<|image>` + `<|image|>` x n + `<image|>`), with the PIL backend's pixel values (unpadded rows)
and patch positions, the projected image embeddings, every layer's hidden states, the logits and
greedy tokens (keys `{case}.*` in reference.safetensors); and the same with
use_bidirectional_attention = "vision" (the 26B/31B mask: image tokens see their whole image on
sliding layers; keys `{case}.bidir.*`), from the same weights.

    /work/venv-mlx/bin/python scripts/make_gemma4_fixtures.py   # ~20 s, offline
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (sets the offline switches, imports torch)

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

OUT = os.path.join(mf.REPO, "tests", "fixtures")
SLIDING, FULL = "sliding_attention", "full_attention"

TEXT = dict(
    vocab_size=mf.MODEL_VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, max_position_embeddings=4096,
    initializer_range=0.2, sliding_window=8, layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    final_logit_softcapping=30.0, tie_word_embeddings=True,
    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                     FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}},
)
E2B = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=mf.MODEL_VOCAB, num_kv_shared_layers=3,
           use_double_wide_mlp=True, num_key_value_heads=1)
A4B = dict(hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
           enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24)
UNIFIED = dict(num_kv_shared_layers=2, attention_k_eq_v=True, num_global_key_value_heads=1)
UNIFIED_VISION = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=64, output_proj_dims=32)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
              position_embedding_size=64)


def perturb_(model, gen):
    with torch.no_grad():
        for _, t in model.named_parameters():
            if t.is_floating_point() and t.dim() == 1:
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def build(kind):
    tok = mf.make_gemma_tokenizer()
    ids = tok.convert_tokens_to_ids
    special = dict(bos_token_id=ids("<bos>"), eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
                   pad_token_id=ids("<pad>"))
    if kind == "moe":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig
        return Gemma4TextConfig(**TEXT | A4B, **special), tok, Gemma4ForCausalLM
    if kind == "unified":
        from transformers import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig
        return Gemma4UnifiedTextConfig(**TEXT | UNIFIED, **special), tok, Gemma4UnifiedForCausalLM
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    # The multimodal ids sit at the top of the (padded) vocabulary, past the tokenizer's entries.
    top = mf.MODEL_VOCAB
    media = dict(boi_token_id=top - 7, eoi_token_id=top - 6, image_token_id=top - 5, video_token_id=top - 4,
                 boa_token_id=top - 3, eoa_token_index=top - 2, audio_token_id=top - 1)
    if kind == "unified_vlm":
        from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration
        cfg = Gemma4UnifiedConfig(text_config=TEXT | UNIFIED | special, vision_config=UNIFIED_VISION,
                                  audio_config=None, tie_word_embeddings=True, **media, **special)
        return cfg, tok, Gemma4UnifiedForConditionalGeneration
    cfg = Gemma4Config(text_config=TEXT | E2B | special, vision_config=VISION, audio_config=None,
                       tie_word_embeddings=True, **media, **special)
    return cfg, tok, Gemma4ForConditionalGeneration


class TextView(torch.nn.Module):
    """What make_fixtures.run_reference hooks: `.model.layers`, `.model.norm`, a causal LM call."""

    def __init__(self, full):
        super().__init__()
        self.full = full
        self.model = full.model.language_model if hasattr(full.model, "language_model") else full.model
        self.config = full.config.get_text_config()
        self.generation_config = full.generation_config

    def forward(self, **kw):
        return self.full(**kw)

    def generate(self, **kw):
        return self.full.generate(**kw)


def make(kind, seed):
    name = {"e2b": "tiny-gemma4", "moe": "tiny-gemma4-moe", "unified": "tiny-gemma4-unified",
            "unified_vlm": "tiny-gemma4-unified-vlm"}[kind]
    torch.manual_seed(seed)
    cfg, tok, cls = build(kind)
    model = cls._from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    perturb_(model, torch.Generator().manual_seed(seed + 1))
    if kind in ("moe", "unified", "unified_vlm"):  # as for tiny-gemma3: the sqrt(H) embedding scale drowns the layers otherwise
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.25)
    model.eval()
    model.generation_config.do_sample = False
    out_dir = os.path.join(OUT, name)
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, f))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    for f in os.listdir(out_dir):  # save_pretrained writes the weights 0600
        os.chmod(os.path.join(out_dir, f), 0o644)

    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    ref = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    view = TextView(ref)
    text_ids = torch.tensor(tok(mf.TEXT_PROMPT)["input_ids"], dtype=torch.int64)
    chat_ids = tok.apply_chat_template(mf.CHAT_MESSAGES, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    if hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = torch.tensor(chat_ids, dtype=torch.int64)
    chat_text = tok.apply_chat_template(mf.CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)

    tensors, check_t = mf.run_reference(view, text_ids, "text", hooks=True)
    t2, check_c = mf.run_reference(view, chat_ids, "chat", hooks=False)
    tensors.update(t2)
    tcfg = view.config
    with torch.no_grad():
        mem = model(input_ids=text_ids[None]).logits[0]
        # Decoding one token over the cache (shared layers reading the stored layers' full K/V)
        # against the prefill: transformers' two forms agree.
        out = ref(input_ids=text_ids[None, :-1], use_cache=True)
        step = ref(input_ids=text_ids[None, -1:], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
    text_model = view.model
    n_text = sum(p.numel() for p in text_model.parameters())
    active = n_text
    if kind == "moe":
        e, k = tcfg.num_experts, tcfg.top_k_experts
        active -= tcfg.num_hidden_layers * (e - k) * 3 * tcfg.hidden_size * tcfg.moe_intermediate_size
    checks = {
        "text": check_t, "chat": check_c,
        "in_memory_vs_reloaded_logits_max_abs_diff": float((mem - tensors["text.logits"]).abs().max()),
        "decode_step_vs_prefill_last_logits_max_abs_diff": float((step - tensors["text.logits"][-1]).abs().max()),
    }
    added = tok.get_added_vocab()
    info = {
        "text_prompt": mf.TEXT_PROMPT,
        "chat_messages": mf.CHAT_MESSAGES,
        "add_generation_prompt": True,
        "chat_text": chat_text,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "num_layers": tcfg.num_hidden_layers,
        "layer_types": list(tcfg.layer_types),
        "kv_sharing_modes": list(tcfg.kv_sharing_modes),
        "model_type": cfg.model_type,
        "seed": seed, "init_std": TEXT["initializer_range"], "perturb": 0.1,
        "n_params": int(sum(p.numel() for p in model.parameters())),
        "n_text_params": int(n_text),
        "n_active_text_params": int(active),
        "eos_token_id": tok.eos_token_id,
        "special_tokens": {k: added[k] for k in sorted(added, key=added.get)},
        "text_input_ids": text_ids.tolist(),
        "chat_input_ids": chat_ids.tolist(),
        "text_generated_ids": tensors["text.generated_ids"].tolist(),
        "chat_generated_ids": tensors["chat.generated_ids"].tolist(),
        "keys": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(tensors.items())},
        "checks": checks,
    }
    if kind in ("e2b", "unified_vlm"):
        add_vision(out_dir, tensors, info, cls, unified=kind == "unified_vlm")
        info["keys"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(tensors.items())}
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"generator": f"scripts/make_gemma4_fixtures.py transformers={transformers.__version__}"})
    with open(os.path.join(out_dir, "reference.json"), "w") as fh:
        json.dump(info, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    for f in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, f), 0o644)
    print(f"{name}: T={text_ids.shape[0]} T2={chat_ids.shape[0]} params={info['n_params']} checks={checks}",
          flush=True)


MM_TOKENS = {1017: "<|image>", 1018: "<image|>", 1019: "<|image|>", 1020: "<|video|>",
             1021: "<|audio>", 1022: "<audio|>", 1023: "<|audio|>"}
# make_fixtures.py's Gemma template, with a message's content parts: `<|image|>` for an image.
VISION_TEMPLATE = """{{ bos_token }}
{%- macro render(content) -%}
    {%- if content is string -%}{{ content | trim }}{%- else -%}
        {%- for item in content -%}
            {%- if item['type'] == 'image' -%}{{ '<|image|>' }}
            {%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = render(messages[0]['content']) + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- render(message['content']) -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
VISION_CASES = {
    "single": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}],
               ["image_square.png"]),
    "nonsquare": ([{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": [{"type": "text", "text": "What is in"},
                                                {"type": "image"}, {"type": "text", "text": "this picture?"}]}],
                  ["image_wide.png"]),
    "multi": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
               {"role": "assistant", "content": "A cat on a mat."},
               {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}],
              ["image_square.png", "image_tall.png"]),
}
VISION_NEW_TOKENS = 10


def test_image(width, height, seed):
    """A smooth pattern plus noise, so that resizing and pooling matter."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.stack([xx * 5 + seed * 40, yy * 6, (xx + yy) * 3], -1).astype(np.int64)
    img = np.clip(img + rng.integers(-20, 21, img.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(img, "RGB")


def add_vision(out_dir, tensors, info, cls, unified=False):
    """Makes a Gemma 4 VLM fixture processor-complete and adds the image cases."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor
    fam = "Gemma4Unified" if unified else "Gemma4"

    tj = json.load(open(os.path.join(out_dir, "tokenizer.json")))
    for i, s in MM_TOKENS.items():
        assert i not in tj["model"]["vocab"].values(), f"id {i} is taken"
        tj["model"]["vocab"][s] = i
        tj["added_tokens"].append({"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True})
    json.dump(tj, open(os.path.join(out_dir, "tokenizer.json"), "w"), ensure_ascii=False)
    tc = json.load(open(os.path.join(out_dir, "tokenizer_config.json")))
    tc.update({"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
               "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
               "extra_special_tokens": ["<|video|>"], "processor_class": f"{fam}Processor"})
    json.dump(tc, open(os.path.join(out_dir, "tokenizer_config.json"), "w"), indent=2)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as fh:
        fh.write(VISION_TEMPLATE)
    p, k = VISION["patch_size"], VISION["pooling_kernel_size"]
    json.dump({
        "processor_class": f"{fam}Processor", "image_seq_length": 70,
        "image_processor": {"image_processor_type": f"{fam}ImageProcessor", "patch_size": p,
                            "pooling_kernel_size": k, "max_soft_tokens": 70, "do_convert_rgb": True,
                            "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                            "do_normalize": False, "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0]},
        "video_processor": {"video_processor_type": f"{fam}VideoProcessor", "patch_size": p,
                            "pooling_kernel_size": k, "max_soft_tokens": 70},
        "feature_extractor": {"feature_extractor_type": f"{fam}AudioFeatureExtractor"},
    }, open(os.path.join(out_dir, "processor_config.json"), "w"), indent=2)
    for name, (w, h, seed) in {"image_square.png": (32, 32, 1), "image_wide.png": (50, 37, 2),
                               "image_tall.png": (18, 70, 3)}.items():
        test_image(w, h, seed).save(os.path.join(out_dir, name))

    proc = AutoProcessor.from_pretrained(out_dir)
    # The PIL backend: iris's resize is Pillow's bicubic, bit for bit (torchvision's differs by
    # 1/255 in about 1% of the values).
    proc.image_processor = AutoImageProcessor.from_pretrained(out_dir, backend="pil")
    model = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    lm = model.model.language_model
    text_cfgs = [model.config.text_config, lm.config]
    info["cases"] = {}
    for case, (messages, files) in VISION_CASES.items():
        images = [Image.open(os.path.join(out_dir, f)).convert("RGB") for f in files]
        prompt = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes <bos> itself (as apply_chat_template(tokenize=True) does, no second one).
        inputs = proc(text=[prompt], images=[images], return_tensors="pt", add_special_tokens=False)
        ids = inputs["input_ids"][0]
        valid = (inputs["image_position_ids"] != -1).all(-1)
        for mode in ["causal", "bidir"]:
            for c in text_cfgs:
                c.use_bidirectional_attention = "vision" if mode == "bidir" else None
            key = case if mode == "causal" else f"{case}.bidir"
            captured = {}
            hooks = [layer.register_forward_hook(
                lambda mod, a, out, i=i: captured.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].clone()))
                for i, layer in enumerate(lm.layers)]
            with torch.no_grad():
                if unified and mode == "bidir":
                    # transformers 5.24's Gemma4UnifiedModel.forward, given no masks, builds
                    # Gemma 3's (image tokens both ways on every layer), while its generate()
                    # builds Gemma 4's (sliding layers only; create_masks_for_generate), which
                    # Gemma 4's own forward also does: the logits are taken with generate()'s.
                    emb = model.get_input_embeddings()(inputs["input_ids"])
                    pos = torch.arange(emb.shape[1])[None]
                    masks = cls.create_masks_for_generate(
                        config=model.config, inputs_embeds=emb, attention_mask=inputs["attention_mask"], cache=None,
                        position_ids=pos, mm_token_type_ids=inputs["mm_token_type_ids"], is_first_iteration=True)
                    out = model(**{k: v for k, v in inputs.items() if k != "attention_mask"}, attention_mask=masks)
                else:
                    out = model(**inputs)
            for h in hooks:
                h.remove()
            tensors[f"{key}.logits"] = out.logits[0].float().contiguous()
            if mode == "causal":
                for i in range(len(lm.layers)):
                    tensors[f"{key}.layer.{i}"] = captured[i].float().contiguous()
                with torch.no_grad():
                    feats = model.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"])
                tensors[f"{key}.image_embeds"] = torch.cat(feats.pooler_output).float().contiguous()
                tensors[f"{key}.input_ids"] = ids.to(torch.int64).contiguous()
                tensors[f"{key}.pixel_values"] = inputs["pixel_values"][valid].float().contiguous()
                tensors[f"{key}.image_position_ids"] = inputs["image_position_ids"][valid].to(torch.int64).contiguous()
            model.generation_config.eos_token_id = None
            with torch.no_grad():
                gen = model.generate(**inputs, do_sample=False, max_new_tokens=VISION_NEW_TOKENS,
                                     min_new_tokens=VISION_NEW_TOKENS)[0, ids.shape[0]:]
            if unified and mode == "bidir":
                # Its generate() over the cache parts from its own forward over the whole sequence
                # after a few tokens (single: at the 4th, multi: at the 2nd; transformers 5.24):
                # the reference is the argmax loop over whole-sequence forwards, generate()'s
                # tokens are kept beside it.
                info["cases"][case]["generated_ids_bidir_generate"] = gen.tolist()
                seq, types = inputs["input_ids"], inputs["mm_token_type_ids"]
                for _ in range(VISION_NEW_TOKENS):
                    emb = model.get_input_embeddings()(seq)
                    masks = cls.create_masks_for_generate(
                        config=model.config, inputs_embeds=emb, attention_mask=torch.ones_like(seq), cache=None,
                        position_ids=torch.arange(seq.shape[1])[None], mm_token_type_ids=types,
                        is_first_iteration=True)
                    with torch.no_grad():
                        logits = model(input_ids=seq, pixel_values=inputs["pixel_values"],
                                       image_position_ids=inputs["image_position_ids"], mm_token_type_ids=types,
                                       attention_mask=masks).logits[0, -1]
                    seq = torch.cat([seq, logits.argmax().view(1, 1)], 1)
                    types = torch.cat([types, torch.zeros(1, 1, dtype=types.dtype)], 1)
                gen = seq[0, ids.shape[0]:]
            tensors[f"{key}.generated_ids"] = gen.to(torch.int64).contiguous()
            if mode == "causal":
                info["cases"][case] = {"messages": messages, "prompt": prompt, "images": files,
                                       "input_ids": ids.tolist(), "generated_ids": gen.tolist(),
                                       "num_soft_tokens": [int(n) for n in (valid.sum(-1) // (1 if unified else k * k)).tolist()]}
            else:
                info["cases"][case]["generated_ids_bidir"] = gen.tolist()
                info["cases"][case]["bidir_vs_causal_logits_max_abs_diff"] = float(
                    (out.logits[0] - tensors[f"{case}.logits"]).abs().max())
        for c in text_cfgs:
            c.use_bidirectional_attention = None


if __name__ == "__main__":
    torch.set_num_threads(2)
    # `make_gemma4_fixtures.py unified`: that fixture alone.
    kinds = sys.argv[1:] or ["e2b", "moe", "unified", "unified_vlm"]
    for kind, seed in [("e2b", 400), ("moe", 401), ("unified", 402), ("unified_vlm", 403)]:
        if kind in kinds:
            make(kind, seed)
