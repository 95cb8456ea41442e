#!/usr/bin/env python3
"""Tiny random Qwen3.5 fixtures (the hybrid Gated DeltaNet family) with transformers as the oracle.

    tests/fixtures/tiny-qwen3.5/      Qwen3_5ForCausalLM (`qwen3_5_text`), text-only layout
                                      (`model.layers.*`), tied embeddings
    tests/fixtures/tiny-qwen3.5-moe/  Qwen3_5MoeForConditionalGeneration (`qwen3_5_moe` with a
                                      `text_config` and a tiny vision tower), the VLM layout
                                      (`model.language_model.*`, `model.visual.*`), tied embeddings;
                                      8 experts (top 2) + a gated shared expert in every layer;
                                      references from its language model on text only

Both (the MoE with hidden 32, to stay small): hidden 64, 4 layers from `full_attention_interval` 4 (3 Gated DeltaNet layers, then gated
full attention), DeltaNet 2 key heads / 4 value heads of 16 (grouped values), conv kernel 4,
attention 4 / 2 heads of 16 with partial rotary 0.5 (8 of 16 dims), interleaved M-RoPE sections
[2, 1, 1] (text only here, so plain rotary). Every 1-D parameter (the (1+w) norms, the gated
norm's w, A_log, dt_bias) gets N(0, 0.1) noise, so a (1+w)-vs-w bug, a swapped gate layout or a
wrong decay changes the outputs.

reference.safetensors has the keys of scripts/make_fixtures.py (text.* with per-layer hidden
states, chat.*), computed from the checkpoint as reloaded from disk. The tokenizer and chat
template are make_fixtures.py's Qwen ones.

    ~/.cache/iris/torch-venv/bin/python scripts/make_qwen35_fixtures.py   # ~20 s, offline
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

TEXT = dict(
    vocab_size=mf.MODEL_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=4096, initializer_range=0.2, attention_bias=False,
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)


def perturb_(model, scale, gen):
    """Noise on every 1-D parameter (norms, gated norm, A_log, dt_bias)."""
    with torch.no_grad():
        for _, t in model.named_parameters():
            if t.is_floating_point() and t.dim() == 1:
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * scale)


def build(kind):
    tok = mf.make_qwen_tokenizer()
    ids = tok.convert_tokens_to_ids
    special = dict(bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                   pad_token_id=ids("<|endoftext|>"))
    if kind == "dense":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        cfg = Qwen3_5TextConfig(**TEXT, tie_word_embeddings=True, **special)
        return cfg, tok, Qwen3_5ForCausalLM
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    text = dict(TEXT, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
                num_experts_per_tok=2, tie_word_embeddings=True, **special)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16)
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **special)
    return cfg, tok, Qwen3_5MoeForConditionalGeneration


class TextView(torch.nn.Module):
    """What make_fixtures.run_reference hooks: `.model.layers`, `.model.norm`, a causal LM call."""

    def __init__(self, full):
        super().__init__()
        self.full = full
        self.model = full.model.language_model if hasattr(full.model, "language_model") else full.model
        self.config = full.config.get_text_config() if hasattr(full.config, "get_text_config") else full.config
        self.generation_config = full.generation_config

    def forward(self, **kw):
        return self.full(**kw)

    def generate(self, **kw):
        return self.full.generate(**kw)


def make(kind, seed):
    name = "tiny-qwen3.5" if kind == "dense" else "tiny-qwen3.5-moe"
    torch.manual_seed(seed)
    cfg, tok, cls = build(kind)
    model = cls._from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    perturb_(model, 0.1, torch.Generator().manual_seed(seed + 1))
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
        # Decoding token by token (the recurrent kernel and the conv update) against the prefill
        # (the chunked kernel): transformers' own two forms agree.
        out = ref(input_ids=text_ids[None, :-1], use_cache=True)
        step = ref(input_ids=text_ids[None, -1:], past_key_values=out.past_key_values, use_cache=True).logits[0, -1]
    text_model = view.model
    n_text = sum(p.numel() for p in text_model.parameters())
    lm_head = ref.lm_head.weight
    tied = lm_head.data_ptr() == text_model.embed_tokens.weight.data_ptr()
    n_text += 0 if tied else lm_head.numel()
    active = n_text
    if kind == "moe":
        e, k = tcfg.num_experts, tcfg.num_experts_per_tok
        per_expert = 3 * tcfg.hidden_size * tcfg.moe_intermediate_size
        active -= tcfg.num_hidden_layers * (e - k) * per_expert
    checks = {
        "text": check_t, "chat": check_c,
        "in_memory_vs_reloaded_logits_max_abs_diff": float((mem - tensors["text.logits"]).abs().max()),
        "decode_step_vs_prefill_last_logits_max_abs_diff": float((step - tensors["text.logits"][-1]).abs().max()),
    }
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"generator": f"scripts/make_qwen35_fixtures.py transformers={transformers.__version__}"})
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
    with open(os.path.join(out_dir, "reference.json"), "w") as fh:
        json.dump(info, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    os.chmod(os.path.join(out_dir, "reference.safetensors"), 0o644)
    print(f"{name}: T={text_ids.shape[0]} T2={chat_ids.shape[0]} params={info['n_params']} checks={checks}",
          flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    make("dense", 350)
    make("moe", 351)
