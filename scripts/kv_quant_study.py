#!/usr/bin/env python3
"""How sensitive a model is to quantized keys and values: a study in transformers, outside iris.

Loads a GGUF (dequantized, f32) with transformers and replaces its attention by one that
fake-quantizes the keys and/or values (quantize, then dequantize) before attending, then
scores a text teacher-forced: perplexity and top-1 agreement against the same model
unquantized. Used to tell apart "iris's TurboQuant cache is wrong" from "this model's keys
are this sensitive", and to try alternatives before building them.

Methods (per setting, comma-separated `key=value` pairs):
  k=B, v=B        bits for keys / values (absent: not quantized)
  method=tq       TurboQuant-MSE: Haar rotation per (layer, K|V), Lloyd-Max codebook of the
                  exact coordinate law, f32 norm (what iris does, up to the rotation family)
  method=q0       per token, blocks of 32 channels, symmetric absmax (llama.cpp q4_0 / q8_0)
  method=kivi     per channel, groups of 32 tokens, asymmetric min-max (KIVI's key scheme)
  win=N           each query reads its last N positions unquantized (iris --kv-float-window)
  scale=1         TurboQuant on k * t, with q / t (exact for q.k): t per (layer, kv head,
                  channel) = (E[q^2] / E[k^2])^(1/4), from a calibration text
  scale=2         the same with keys' statistics only: t = E[k^2]^(-1/4)
  only=[L,...]    quantize these layers only

Usage:
  /work/venv-bench/bin/python scripts/kv_quant_study.py MODEL.gguf TEXT CALIB_TEXT TOKENS \\
      "k=4" "k=4,method='kivi'" "k=4,scale=1" "k=3,v=4,win=128"
"""
import math
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, GgufConfig

torch.set_num_threads(2)


def lloyd_max(d, bits):
    """Centroids and boundaries for one coordinate of a random unit vector in d dims."""
    zmax = min(math.sqrt(d), 12.0)
    z = np.linspace(-zmax, zmax, 200001)
    f = np.clip(1 - z * z / d, 0, None) ** ((d - 3) / 2)
    f /= f.sum()
    c = np.linspace(-2, 2, 2**bits)
    for _ in range(2000):
        idx = np.searchsorted((c[1:] + c[:-1]) / 2, z)
        nc = np.array([(z * f)[idx == k].sum() / f[idx == k].sum() for k in range(2**bits)])
        if abs(nc - c).max() < 1e-10:
            break
        c = nc
    t = lambda x: torch.tensor(x / math.sqrt(d), dtype=torch.float32)
    return t(c), t((c[1:] + c[:-1]) / 2)


_codebooks, _rotations = {}, {}


def turboquant(x, bits, seed):
    d = x.shape[-1]
    if (d, bits) not in _codebooks:
        _codebooks[(d, bits)] = lloyd_max(d, bits)
    if (d, seed) not in _rotations:
        g = torch.Generator().manual_seed(seed)
        q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        _rotations[(d, seed)] = (q * torch.sign(torch.diagonal(r))).float()
    c, bounds = _codebooks[(d, bits)]
    rot = _rotations[(d, seed)]
    n = x.norm(dim=-1, keepdim=True)
    y = (x / n.clamp_min(1e-6)) @ rot.T
    return (c[torch.bucketize(y, bounds)] @ rot) * n


def absmax_blocks(x, bits, block=32):
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block)
    qmax = 2 ** (bits - 1) - 1
    step = xb.abs().amax(-1, keepdim=True).clamp_min(1e-8) / qmax
    return (torch.round(xb / step).clamp(-qmax - 1, qmax) * step).reshape(shape)


def kivi(x, bits, group=32):
    out = x.clone()
    for t0 in range(0, x.shape[2], group):
        xs = x[:, :, t0 : t0 + group]
        lo, hi = xs.amin(2, keepdim=True), xs.amax(2, keepdim=True)
        step = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
        out[:, :, t0 : t0 + group] = torch.round((xs - lo) / step) * step + lo
    return out


def quantize(x, bits, seed, method):
    if bits is None:
        return x
    if method == "q0":
        return absmax_blocks(x, bits)
    if method == "kivi":
        return kivi(x, bits)
    return turboquant(x, bits, seed)


SETTING, CALIB, SCALES = {}, {}, {}


def attention(module, q, k, v, mask, scaling=None, dropout=0.0, **kw):
    """Causal (and sliding-window) attention on fake-quantized keys/values; [b, h, T, d]."""
    li = module.layer_idx
    if SETTING.get("calibrating"):
        CALIB.setdefault(li, []).append((q.detach(), k.detach()))
    kb, vb = SETTING.get("k"), SETTING.get("v")
    if "only" in SETTING and li not in SETTING["only"]:
        kb = vb = None
    method = SETTING.get("method", "tq")
    t = SCALES[(li, SETTING["scale"])] if SETTING.get("scale") and kb is not None else 1.0
    kq = quantize(k * t, kb, 2 * li, method) / t
    vq = quantize(v, vb, 2 * li + 1, method)
    rep = q.shape[1] // k.shape[1]
    kf, vf, kq, vq = (x.repeat_interleave(rep, 1) for x in (k, v, kq, vq))
    T = q.shape[2]
    p, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    float_pos = (p - j) < SETTING.get("win", 0)
    s = torch.where(float_pos, q @ kf.transpose(-1, -2), q @ kq.transpose(-1, -2)) * scaling
    s = s.masked_fill(j > p, float("-inf"))
    if getattr(module, "sliding_window", None):
        s = s.masked_fill(j <= p - module.sliding_window, float("-inf"))
    a = torch.softmax(s, -1)
    o = (a * float_pos) @ vf + (a * ~float_pos) @ vq
    return o.transpose(1, 2).contiguous(), None


def main():
    model_path, text, calib_text, n = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=model_path.name, dequantize=True))
    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    model.eval()
    AttentionInterface.register("fake_quant", attention)
    model.config._attn_implementation = "fake_quant"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "fake_quant"

    # Calibration statistics for scale=1, from a different text.
    SETTING.update(calibrating=True)
    with torch.no_grad():
        model(tok(open(calib_text).read(), return_tensors="pt").input_ids[:, :512])
    SETTING.clear()
    for li, batches in CALIB.items():
        q = torch.cat([b[0] for b in batches], 2)
        k = torch.cat([b[1] for b in batches], 2)
        hkv = k.shape[1]
        eq = q.pow(2).mean(2).reshape(1, hkv, q.shape[1] // hkv, -1).mean(2).unsqueeze(2)
        ek = k.pow(2).mean(2, keepdim=True)
        SCALES[(li, 1)] = (eq.clamp_min(1e-8) / ek.clamp_min(1e-8)).pow(0.25)
        SCALES[(li, 2)] = ek.clamp_min(1e-8).pow(-0.25)

    ids = tok(open(text).read(), return_tensors="pt").input_ids[:, :n]

    def score():
        with torch.no_grad():
            logits = model(ids).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1)
        return math.exp(-lp.gather(1, ids[0, 1:, None]).mean().item()), logits.argmax(-1)

    base, top1 = score()
    print(f"{ids.shape[1]} tokens; unquantized perplexity {base:.4f}")
    for spec in sys.argv[5:]:
        SETTING.clear()
        SETTING.update(eval(f"dict({spec})"))
        ppl, t = score()
        agree = (t == top1).float().mean().item() * 100
        print(f"{spec:40s} perplexity {ppl:.4f} ({(ppl / base - 1) * 100:+.2f}%), top-1 agreement {agree:.1f}%",
              flush=True)


if __name__ == "__main__":
    main()
