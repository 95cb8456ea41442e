#!/usr/bin/env python3
"""GPU benchmark helper for scripts/gpu-bench.sh (runs on the GPU machine, no network needed).

    gpu_bench.py make DIR MODEL        random-weight checkpoint (seeded normal * 0.02, bf16) of
                                       MODEL (qwen2.5-7b | smollm2-135m | gemma4-e4b |
                                       qwen3.5-27b | qwen3.5-35b-a3b, the last three built by
                                       transformers from their configs: they need
                                       transformers >= 5.24 there) + a word-level tokenizer
                                       covering its whole vocabulary; MODEL+bytes: a byte-level
                                       tokenizer instead (its first 256 ids the bytes, the rest
                                       filler), which can spell any text (structured outputs);
                                       MODEL+mlx4 / MODEL+mlx8: the same weights quantized as
                                       an MLX affine checkpoint (group 64, bf16 scales and biases,
                                       every linear layer, the embedding left bf16)
    gpu_bench.py gguf FILE MODEL       the same random weights (qwen2.5-7b or smollm2-135m) as an F16
                                       GGUF, as llama.cpp's converter names them, with a byte-level
                                       BPE tokenizer (gpt2; 256 byte tokens, one merge, filler), for
                                       llama.cpp's quantize tool and both engines (needs gguf-py:
                                       GGUF_PY=DIR, e.g. llama.cpp's gguf-py)
    gpu_bench.py bandwidth             device-to-device copy bandwidth (bytes read + written / s)
    gpu_bench.py hf DIR                transformers generate on DIR: decode tok/s at --batches,
                                       prefill tok/s and TTFT for a --prefill-len prompt
    gpu_bench.py table RESULTS.json    the summary table

Each subcommand prints one JSON object on its last stdout line.
"""
import argparse
import json
import os
import sys
import time

CONFIGS = {
    # Qwen/Qwen2.5-7B-Instruct config.json (architecture numbers only).
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        hidden_act="silu", bos_token_id=151643, eos_token_id=151645, sliding_window=None,
        use_sliding_window=False, torch_dtype="bfloat16",
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json.
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        hidden_act="silu", bos_token_id=1, eos_token_id=2, head_dim=64, torch_dtype="bfloat16",
    ),
    # google/gemma-4-E4B-it's text_config (architecture numbers as transcribed by several public
    # ports; the checkpoint itself is out of reach here): PLE, KV sharing, 512-wide global heads.
    "gemma4-e4b": dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
        num_kv_shared_layers=18, use_double_wide_mlp=False, attention_k_eq_v=False, enable_moe_block=False,
        sliding_window=512, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                            "partial_rotary_factor": 0.25}},
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072, bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16",
    ),
    # Qwen3.5-27B-class text model (hidden 5120, 64 layers, 24 heads / 4 KV of dim 256,
    # intermediate 17408: a third-party transcription, see ../shared/notes/qwen35-mtp-gemma4-mlx.md;
    # GDN 16 key / 48 value heads of 128): 3 Gated DeltaNet layers to 1 gated attention layer.
    "qwen3.5-27b": dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, vocab_size=248320, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", bos_token_id=248044, eos_token_id=248044,
        torch_dtype="bfloat16",
    ),
    # Qwen3.5-35B-A3B's text model (the same transcription): 40 layers, 256 experts of 512, top 8,
    # a shared expert of 512.
    "qwen3.5-35b-a3b": dict(
        architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
        num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=248320,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", bos_token_id=248044, eos_token_id=248044,
        torch_dtype="bfloat16",
    ),
}

# The text `iris bench` tokenizes (src/cli/bench.rs); its words get the first ids.
BENCH_TEXT = ("The quick brown fox jumps over the lazy dog while the children watch from the window. "
              "In the morning the market fills with people buying bread, fruit and fresh fish from the harbour. ")


def make(out, name):
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    base, _, kind = name.partition("+")
    cfg = dict(CONFIGS[base])
    mlx_bits = int(kind[3:]) if kind.startswith("mlx") else None
    if mlx_bits:
        cfg["quantization"] = {"group_size": 64, "bits": mlx_bits, "mode": "affine"}
        cfg["quantization_config"] = cfg["quantization"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if kind == "bytes":
        from tokenizers import decoders
        words = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {w: i for i, w in enumerate(words)}
        for i in range(len(words), cfg["vocab_size"]):
            vocab[f"<t{i}>"] = i
        tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        words = list(dict.fromkeys(BENCH_TEXT.split()))
        vocab = {w: i for i, w in enumerate(words)}
        for i in range(len(words), cfg["vocab_size"]):
            vocab[f"<t{i}>"] = i
        tok = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(out, "tokenizer.json"))

    if cfg["model_type"] in ("gemma4_text", "qwen3_5_text", "qwen3_5_moe_text"):
        return make_with_transformers(out, name, cfg)
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // nh)
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nh * d),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if cfg["model_type"] == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": (nh * d,), p + "self_attn.k_proj.bias": (nkv * d,),
                           p + "self_attn.v_proj.bias": (nkv * d,)})
    dev = os.environ.get("BENCH_TORCH_DEVICE", "cuda")
    g = torch.Generator(device=dev).manual_seed(1234)
    tensors = {}
    for n, s in shapes.items():
        if n.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(s, generator=g, device=dev)
        else:
            t = 0.02 * torch.randn(s, generator=g, device=dev)
        t = t.to(torch.bfloat16)
        if mlx_bits and len(s) == 2 and n != "model.embed_tokens.weight":
            tensors.update(mlx_quantize(n[: -len(".weight")], t.float(), mlx_bits, 64))
        else:
            tensors[n] = t.cpu()
    # Shards of about 4 GB, as checkpoints on the Hub come.
    shards, cur, size = [], {}, 0
    for n, t in tensors.items():
        cur[n] = t
        size += t.numel() * t.element_size()
        if size > 4e9:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    weight_map = {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, os.path.join(out, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in sh})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    emb = cfg["vocab_size"] * h * 2
    print(json.dumps({"model": name, "weight_bytes": nbytes, "embedding_bytes": emb,
                      "tied": cfg["tie_word_embeddings"],
                      "format": f"MLX {mlx_bits}-bit g64" if mlx_bits else "bf16"}))


def make_with_transformers(out, name, cfg):
    """The model transformers builds from `cfg`, its weights redrawn (seeded normal * 0.02, norms
    1 + 0.1 * normal), saved in bf16 shards."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.environ.get("BENCH_LAYERS"):
        # Fewer layers of the same shapes (a quick profile); a hybrid keeps its 3:1 pattern.
        cfg["num_hidden_layers"] = int(os.environ["BENCH_LAYERS"])
    conf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(1234)
    with torch.device(os.environ.get("BENCH_TORCH_DEVICE", "cuda")):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(1234)
    read, nbytes, ple = 0, 0, 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 0:
                continue
            base = 1.0 if "norm" in n and p.dim() == 1 else 0.0
            p.copy_((base + (0.1 if base else 0.02) * torch.randn(p.shape, generator=g, device=p.device)).to(p.dtype))
            nbytes += p.numel() * p.element_size()
            # Per-layer-embedding rows are looked up, not read whole, each step.
            if "embed_tokens_per_layer" in n:
                ple += p.numel() * p.element_size()
    model.save_pretrained(out, max_shard_size="4GB")
    emb = cfg["vocab_size"] * cfg["hidden_size"] * 2
    print(json.dumps({"model": name, "weight_bytes": nbytes, "embedding_bytes": emb, "tied": cfg["tie_word_embeddings"],
                      "lookup_bytes": ple, "format": "bf16"}))


def make_vl(out):
    """A Qwen2.5-VL-7B-shaped checkpoint (the text model of Qwen2.5-7B, a 32-block vision tower
    of width 1280 with windowed attention), random bf16 weights as make_with_transformers
    draws them. Tokenizer, chat template and image processor are the tiny Qwen2.5-VL fixture's
    (its 512-token vocabulary with the vision tokens; the LM head is then small, which a TTFT
    barely feels), the processor's pixel limits the real model's."""
    import shutil
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    fix = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tiny-qwen2.5-vl")
    with open(os.path.join(fix, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, layer_types=["full_attention"] * 28, max_position_embeddings=32768,
               rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, initializer_range=0.02)
    cfg["vision_config"].update(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                out_hidden_size=3584, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                initializer_range=0.02)
    if os.environ.get("BENCH_LAYERS"):
        cfg["num_hidden_layers"] = int(os.environ["BENCH_LAYERS"])
        cfg["layer_types"] = cfg["layer_types"][: cfg["num_hidden_layers"]]
    os.makedirs(out, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(fix, name)):
            shutil.copy(os.path.join(fix, name), out)
    with open(os.path.join(fix, "preprocessor_config.json")) as f:
        pre = json.load(f)
    pre.update(min_pixels=3136, max_pixels=12845056)
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=1)
    conf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "dtype", "transformers_version")})
    with torch.device(os.environ.get("BENCH_TORCH_DEVICE", "cuda")):
        model = AutoModelForImageTextToText.from_config(conf, dtype=torch.bfloat16)
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(1234)
    nbytes = 0
    with torch.no_grad():
        for n, p in model.named_parameters():
            base = 1.0 if "norm" in n and p.dim() == 1 else 0.0
            p.copy_((base + (0.1 if base else 0.02) * torch.randn(p.shape, generator=g, device=p.device)).to(p.dtype))
            nbytes += p.numel() * p.element_size()
    model.save_pretrained(out, max_shard_size="4GB")
    print(json.dumps({"model": "qwen2.5-vl-7b", "weight_bytes": nbytes, "format": "bf16"}))


def mlx_quantize(module, w, bits, group):
    """MLX affine quantization of w [out, in] (bits dividing 32): per group of `group` weights
    scale = (max - min) / (2^bits - 1), bias = min, q = round((w - bias) / scale); the codes
    packed little-endian into u32 words, element i of a word at bits i*bits (as mx.quantize
    packs them); scales and biases in bf16, the codes computed against them."""
    import torch
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    n = 2 ** bits - 1
    scale = ((hi - lo) / n).clamp(min=1e-7).to(torch.bfloat16)
    bias = lo.to(torch.bfloat16)
    q = torch.round((g - bias.float()) / scale.float()).clamp(0, n).to(torch.int64).reshape(rows, cols)
    per = 32 // bits
    shifts = torch.arange(per, device=w.device, dtype=torch.int64) * bits
    words = (q.reshape(rows, cols // per, per) << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).view(torch.uint32)
    return {f"{module}.weight": words.cpu(), f"{module}.scales": scale.squeeze(-1).cpu(),
            f"{module}.biases": bias.squeeze(-1).cpu()}


def gguf(out, name):
    import numpy as np
    try:
        import torch
    except ImportError:  # numpy's generator instead (slower; for small models off the GPU machine)
        torch = None
    sys.path.insert(0, os.environ.get("GGUF_PY", "gguf-py"))
    import gguf as gg

    cfg = CONFIGS[name]
    if cfg["model_type"] not in ("qwen2", "llama"):
        sys.exit(f"gguf: {name} is not a llama or qwen2 model")
    arch = cfg["model_type"]
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    d = h // nh
    w = gg.GGUFWriter(out, arch)
    w.add_name(f"random {name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_block_count(L)
    w.add_feed_forward_length(inter)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gg.LlamaFileType.MOSTLY_F16)
    # Byte-level BPE: the 256 byte symbols, one merge (llama.cpp wants the key), filler tokens
    # (control tokens where the config names bos and eos).
    byte_syms = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    byte_syms += [chr(256 + i) for i in range(256 - len(byte_syms))]
    tokens = byte_syms + ["\u0120\u0120"] + [f"<t{i}>" for i in range(257, vocab)]
    types = [gg.TokenType.NORMAL] * vocab
    # bos and eos where the config has them, unless that is a byte's place (then the last ids).
    bos, eos = (t if t > 256 else vocab - 2 + i for i, t in enumerate((cfg["bos_token_id"], cfg["eos_token_id"])))
    for t in (bos, eos):
        types[t] = gg.TokenType.CONTROL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    if torch is not None:
        dev = os.environ.get("BENCH_TORCH_DEVICE", "cuda")
        g = torch.Generator(device=dev).manual_seed(1234)
        randn = lambda shape: torch.randn(shape, generator=g, device=dev).cpu().numpy()  # noqa: E731
    else:
        rng = np.random.default_rng(1234)
        randn = lambda shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731

    def add(n, shape, norm=False):
        t = (1.0 + 0.1 * randn(shape)) if norm else 0.02 * randn(shape)
        # Norms and biases f32, as the converter writes them; matrices f16.
        w.add_tensor(n, t.astype(np.float32 if norm or len(shape) == 1 else np.float16))

    add("token_embd.weight", (vocab, h))
    for i in range(L):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (h,), norm=True)
        add(p + "attn_q.weight", (nh * d, h))
        add(p + "attn_k.weight", (nkv * d, h))
        add(p + "attn_v.weight", (nkv * d, h))
        if arch == "qwen2":
            add(p + "attn_q.bias", (nh * d,))
            add(p + "attn_k.bias", (nkv * d,))
            add(p + "attn_v.bias", (nkv * d,))
        add(p + "attn_output.weight", (h, nh * d))
        add(p + "ffn_norm.weight", (h,), norm=True)
        add(p + "ffn_gate.weight", (inter, h))
        add(p + "ffn_up.weight", (inter, h))
        add(p + "ffn_down.weight", (h, inter))
    add("output_norm.weight", (h,), norm=True)
    if not cfg["tie_word_embeddings"]:
        add("output.weight", (vocab, h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(json.dumps({"model": name, "gguf": out, "bytes": os.path.getsize(out)}))


def bandwidth():
    import torch
    n = 2 << 30  # 2 GiB per buffer
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    bw = 2 * n / times[len(times) // 2]
    print(json.dumps({"copy_bytes_per_s": bw, "device": torch.cuda.get_device_name()}))


def gemv():
    """cuBLAS (through torch) on Qwen2.5-7B's decode matrix products: achieved bandwidth."""
    import torch
    res = {}
    shapes = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
              "lm_head": (152064, 3584)}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for w in ws:
                x @ w.T
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for i in range(40):
                x @ ws[i % 4].T
            e.record()
            e.synchronize()
            t = s.elapsed_time(e) / 40 / 1e3
            res[f"{name}_m{m}"] = {"us": t * 1e6, "tb_s": n * k * 2 / t / 1e12}
    print("cuBLAS (torch) decode products: " + ", ".join(f"{k} {v['us']:.0f} us {v['tb_s']:.2f} TB/s" for k, v in res.items()))
    print(json.dumps(res))


def hf(path, batches, gen, prefill_len):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def run(b, plen, new):
        ids = torch.randint(10, vocab - 10, (1, plen), generator=g).repeat(b, 1).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(1, 16, 4)  # warm-up
    res = {"transformers": transformers.__version__, "torch": torch.__version__, "decode": {}}
    for b in batches:
        t1 = run(b, 128, 1)
        tn = run(b, 128, gen)
        res["decode"][str(b)] = b * (gen - 1) / max(tn - t1, 1e-9)
    t = min(run(1, prefill_len, 1) for _ in range(2))
    res["prefill_tok_s"] = prefill_len / t
    res["ttft_ms"] = t * 1e3
    print(json.dumps(res))


def table(path):
    r = json.load(open(path))
    bw = r["bandwidth"]["copy_bytes_per_s"]
    print(f"card: {r['bandwidth']['device']}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    for m in r["models"]:
        wb, eb = m["weights"]["weight_bytes"], m["weights"]["embedding_bytes"]
        # Batch-1 bound: every weight byte read once per token; an untied embedding table is not
        # read (its rows are looked up), a tied one is the output head.
        bound = bw / (wb - (0 if m["weights"].get("tied") else eb) - m["weights"].get("lookup_bytes", 0))
        fmt = m["weights"].get("format", "bf16")
        print(f"\n## {m['model']} ({fmt}, {wb / 1e9:.2f} GB of weights as stored; batch-1 bound {bound:.0f} tok/s)")
        print(f"| engine | b1 tok/s | % of bound | b8 | b64 | b256 | prefill tok/s ({m['prefill_len']}) | TTFT ms |")
        print("|---|---|---|---|---|---|---|---|")
        for eng in ("iris", "transformers"):
            e = m.get(eng)
            if not e:
                continue
            d = e["decode"]
            f = lambda b: f"{d[b]:.0f}" if b in d else "-"
            pct = f"{100 * d['1'] / bound:.0f}%" if "1" in d else "-"
            print(f"| {eng} | {f('1')} | {pct} | {f('8')} | {f('64')} | {f('256')} | "
                  f"{e['prefill_tok_s']:.0f} | {e['ttft_ms']:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out")
    m.add_argument("model", choices=sorted(CONFIGS) + sorted(f"{c}+{k}" for c in CONFIGS for k in ("bytes", "mlx4", "mlx8")))
    gf = sub.add_parser("gguf")
    gf.add_argument("out")
    gf.add_argument("model", choices=sorted(CONFIGS))
    v = sub.add_parser("make-vl")
    v.add_argument("out")
    sub.add_parser("bandwidth")
    sub.add_parser("gemv")
    h = sub.add_parser("hf")
    h.add_argument("path")
    h.add_argument("--batches", default="1,8,64,256")
    h.add_argument("--gen", type=int, default=32)
    h.add_argument("--prefill-len", type=int, default=2048)
    t = sub.add_parser("table")
    t.add_argument("results")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.out, a.model)
    elif a.cmd == "gguf":
        gguf(a.out, a.model)
    elif a.cmd == "make-vl":
        make_vl(a.out)
    elif a.cmd == "bandwidth":
        bandwidth()
    elif a.cmd == "gemv":
        gemv()
    elif a.cmd == "hf":
        hf(a.path, [int(x) for x in a.batches.split(",")], a.gen, a.prefill_len)
    else:
        table(a.results)


if __name__ == "__main__":
    sys.exit(main())
