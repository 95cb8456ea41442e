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

Both: hidden 64, 4 heads; sliding layers 2 KV heads of 16 (window 8, shorter than the prompts),
full layers heads of 32 with "proportional" RoPE (partial factor 0.25: 4 of 16 angles turn, the
rest are identity); plain-w RMSNorms, q/k/v norms, attention scale 1, final logit soft-cap 30,
tied head. Every 1-D parameter gets N(0, 0.1) noise and every `layer_scalar` a value in
[0.5, 1.5], so a (1+w)-vs-w bug, a skipped scalar or a wrong router scale changes the outputs.

reference.safetensors has the keys of scripts/make_fixtures.py (text.* with per-layer hidden
states, chat.*), computed from the checkpoint as reloaded from disk. The tokenizer and chat
template are make_fixtures.py's Gemma ones.

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
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    # The multimodal ids sit at the top of the (padded) vocabulary, past the tokenizer's entries.
    top = mf.MODEL_VOCAB
    media = dict(boi_token_id=top - 7, eoi_token_id=top - 6, image_token_id=top - 5, video_token_id=top - 4,
                 boa_token_id=top - 3, eoa_token_index=top - 2, audio_token_id=top - 1)
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
    name = "tiny-gemma4" if kind == "e2b" else "tiny-gemma4-moe"
    torch.manual_seed(seed)
    cfg, tok, cls = build(kind)
    model = cls._from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    perturb_(model, torch.Generator().manual_seed(seed + 1))
    if kind == "moe":  # as for tiny-gemma3: the sqrt(H) embedding scale drowns the layers otherwise
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
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"generator": f"scripts/make_gemma4_fixtures.py transformers={transformers.__version__}"})
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
    with open(os.path.join(out_dir, "reference.json"), "w") as fh:
        json.dump(info, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    os.chmod(os.path.join(out_dir, "reference.safetensors"), 0o644)
    print(f"{name}: T={text_ids.shape[0]} T2={chat_ids.shape[0]} params={info['n_params']} checks={checks}",
          flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    make("e2b", 400)
    make("moe", 401)
