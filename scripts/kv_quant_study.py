#!/usr/bin/env python3
"""How sensitive a model is to quantized keys and values: a study in transformers, outside iris.

Loads a GGUF (dequantized, f32) with transformers and replaces its attention by one that
fake-quantizes the keys and/or values (quantize, then dequantize) before attending, then
scores a text teacher-forced: perplexity, top-1 agreement and the mean KL divergence of the
next-token distribution against the same model unquantized (the KL is far less noisy than a
perplexity ratio). Used to tell apart "iris's TurboQuant cache is wrong" from "this model's keys
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
  pair=1          with scale: one scale per rotary pair of channels (as iris)
  kmean=1         quantize k - m, m the keys' per-(layer, kv head, channel) mean over the
                  calibration text (exact: q.m is the same for every key of a query, and
                  softmax ignores it); with scale=1, t comes from the centred keys
  rmean=1         quantize k - R(t) m, m the keys' mean before rotary per (layer, kv head,
                  channel) over the calibration text, turned to the key's position t (exact:
                  q.R(t)m is computed in full per key, a dot with the rotary table's row t);
                  unlike kmean it holds at every position, since it turns with the key
  rmeanp=P        with rmean: only the P rotary pairs with the largest mean energy
  vmean=1         quantize v - m_v and add m_v back (exact: the weights sum to 1)
  outl=N          keep the N rotary pairs of key channels with the most energy on the
                  calibration text in bf16 (per layer and kv head) and quantize the rest (an
                  outlier-channel split; costs 32 N bits per key vector)
  split=G,khi=B   keys in two groups, each its own rotation, norm and codebook: the G rotary
                  pairs with the largest sqrt(E[q^2] E[k^2]) (per layer and kv head, calibration
                  text) at B bits, the rest at k bits (a bit allocation by importance)
  bmean=B         quantize k - m_b, m_b the mean of each block of B positions per kv head and
                  channel (stored in bf16: 16 / B more bits per coordinate); exact for the
                  same reason as kmean, but local, so rotary's turning does not matter
  sink=N          positions j < N are read unquantized too (attention sinks)
  ncorr=1         store n / ||c[idx]|| instead of n, so the decoded vector has the true norm
                  (a Lloyd-Max reconstruction is shorter than its input by about sqrt(1 - D))
  seed=S          another draw of the random rotations
  shift=N         turn queries and keys by N more rotary positions (exact attention only sees
                  relative positions and does not change; a scaling fitted on the calibration
                  text's positions may not hold at others)
  only=[L,...]    quantize these layers only

Usage (CALIB_TEXT `iris`: the built-in text iris calibrates on; TOKENS: how many to score):
  /work/venv-bench/bin/python scripts/kv_quant_study.py MODEL.gguf TEXT CALIB_TEXT TOKENS SETTING...
  e.g. ... /usr/share/common-licenses/GPL-3 iris 1024 "k=4,v=4" "k=4,v=4,scale=1,pair=1"
"""
import math
import re
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
    cy = c[torch.bucketize(y, bounds)]
    if SETTING.get("ncorr"):
        n = n / cy.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return (cy @ rot) * n


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


SETTING, CALIB, SCALES, MODULES = {}, {}, {}, {}


ROTARY = []


def rope_shift(x, n, module):
    """x turned by n more positions (transformers' half-split rotary layout)."""
    rot = ROTARY[0]
    lt = getattr(module, "layer_type", None)
    inv = getattr(rot, f"{lt}_inv_freq", None) if lt else None
    inv = rot.inv_freq if inv is None else inv
    ang = n * inv.double()
    c, s = ang.cos().float(), ang.sin().float()
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def rope_turn(x, pos, module):
    """x [.., T, d] turned by pos[T] positions each (negative: undo rotary)."""
    rot = ROTARY[0]
    lt = getattr(module, "layer_type", None)
    inv = getattr(rot, f"{lt}_inv_freq", None) if lt else None
    inv = rot.inv_freq if inv is None else inv
    ang = pos.double()[:, None] * inv.double()[None, :]
    c, s = ang.cos().float(), ang.sin().float()
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def attention(module, q, k, v, mask, scaling=None, dropout=0.0, **kw):
    """Causal (and sliding-window) attention on fake-quantized keys/values; [b, h, T, d]."""
    li = module.layer_idx
    if SETTING.get("shift"):
        q, k = (rope_shift(x, SETTING["shift"], module) for x in (q, k))
    if SETTING.get("calibrating"):
        CALIB.setdefault(li, []).append((q.detach(), k.detach(), v.detach()))
        MODULES[li] = module
    kb, vb = SETTING.get("k"), SETTING.get("v")
    if "only" in SETTING and li not in SETTING["only"]:
        kb = vb = None
    method = SETTING.get("method", "tq")
    centre = "k" if SETTING.get("kmean") else "r" if SETTING.get("rmean") else False
    km = SCALES[(li, "kmean")] if SETTING.get("kmean") else 0.0
    if SETTING.get("rmean"):
        m = SCALES[(li, "rmean")]
        if SETTING.get("rmeanp"):
            # Only the P rotary pairs with the most mean energy keep their mean.
            half = m.shape[-1] // 2
            e = m.pow(2) + m.pow(2).roll(half, -1)
            top = e[..., :half].topk(SETTING["rmeanp"], -1).indices
            keep = torch.zeros_like(m, dtype=torch.bool)
            keep.scatter_(-1, top, True)
            keep.scatter_(-1, top + half, True)
            m = m * keep
        pos = torch.arange(k.shape[2]) + SETTING.get("shift", 0)
        km = rope_turn(m.expand(k.shape[0], -1, k.shape[2], -1), pos, module)
    vm = SCALES[(li, "vmean")] if SETTING.get("vmean") else 0.0
    scale = SETTING.get("scale")
    t = SCALES[(li, scale, centre, bool(SETTING.get("pair")))] if scale and kb is not None else 1.0
    seed = 2 * li + 1000 * SETTING.get("seed", 0)
    if SETTING.get("bmean") and kb is not None:
        B, T0 = SETTING["bmean"], k.shape[2]
        pad = (-T0) % B
        kp = torch.nn.functional.pad(k, (0, 0, 0, pad))
        blocks = kp.reshape(k.shape[0], k.shape[1], -1, B, k.shape[3])
        n = (torch.arange(T0 + pad) < T0).reshape(-1, B).sum(1)  # positions per block (the last may be short)
        m = (blocks.sum(3, keepdim=True) / n[None, None, :, None, None]).bfloat16().float()
        km = m.expand_as(blocks).reshape(kp.shape)[:, :, :T0]
    kq = quantize((k - km) * t, kb, seed, method) / t + km if kb is not None else k
    if SETTING.get("split") and kb is not None:
        hi_mask = SCALES[(li, "imp", SETTING["split"])]  # [1, hkv, 1, d]
        kt = (k - km) * t
        kq = torch.empty_like(k)
        for h in range(k.shape[1]):
            hi = hi_mask[0, h, 0].nonzero().flatten()
            lo = (~hi_mask[0, h, 0]).nonzero().flatten()
            kq[:, h][..., hi] = quantize(kt[:, h][..., hi], SETTING["khi"], seed + 7, method)
            kq[:, h][..., lo] = quantize(kt[:, h][..., lo], kb, seed, method)
        kq = kq / t + km
    if SETTING.get("outl") and kb is not None:
        keep = SCALES[(li, "outl", SETTING["outl"])]
        kq = quantize(k * t * ~keep, kb, seed, method) / t * ~keep + (k * keep).bfloat16().float()
    vq = quantize(v - vm, vb, seed + 1, method) + vm if vb is not None else v
    rep = q.shape[1] // k.shape[1]
    kf, vf, kq, vq = (x.repeat_interleave(rep, 1) for x in (k, v, kq, vq))
    T = q.shape[2]
    p, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    float_pos = ((p - j) < SETTING.get("win", 0)) | (j < SETTING.get("sink", 0))
    s = torch.where(float_pos, q @ kf.transpose(-1, -2), q @ kq.transpose(-1, -2)) * scaling
    s = s.masked_fill(j > p, float("-inf"))
    if getattr(module, "sliding_window", None):
        s = s.masked_fill(j <= p - module.sliding_window, float("-inf"))
    a = torch.softmax(s, -1)
    o = (a * float_pos) @ vf + (a * ~float_pos) @ vq
    return o.transpose(1, 2).contiguous(), None


def read_calibration_text(arg):
    """A file, or `iris`: the text iris calibrates on (src/engine/calibrate.rs)."""
    if arg != "iris":
        return open(arg).read()
    src = (Path(__file__).parent.parent / "src/engine/calibrate.rs").read_text()
    body = re.search(r'const TEXT: &str = "(.*?)";', src, re.S).group(1)
    return re.sub(r"\\\n\s*", "", body).replace("\\n", "\n")


def main():
    model_path, text, calib_text, n = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=model_path.name, dequantize=True))
    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    model.eval()
    ROTARY.append(model.model.rotary_emb)
    AttentionInterface.register("fake_quant", attention)
    model.config._attn_implementation = "fake_quant"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "fake_quant"

    # Calibration statistics (scale, kmean, vmean, outl), from a different text.
    SETTING.update(calibrating=True)
    with torch.no_grad():
        model(tok(read_calibration_text(calib_text), return_tensors="pt").input_ids[:, :512])
    SETTING.clear()
    for li, batches in CALIB.items():
        q = torch.cat([b[0] for b in batches], 2)
        k = torch.cat([b[1] for b in batches], 2)
        v = torch.cat([b[2] for b in batches], 2)
        hkv = k.shape[1]
        eq = q.pow(2).mean(2).reshape(1, hkv, q.shape[1] // hkv, -1).mean(2).unsqueeze(2)
        SCALES[(li, "kmean")] = k.mean(2, keepdim=True)
        SCALES[(li, "vmean")] = v.mean(2, keepdim=True)
        k_pre = rope_turn(k, -torch.arange(k.shape[2]), MODULES[li])
        SCALES[(li, "rmean")] = k_pre.mean(2, keepdim=True)
        half = k.shape[-1] // 2
        pair_k = k.pow(2).mean(2) + k.pow(2).mean(2).roll(half, -1)  # [1, hkv, d]
        for pairs in range(1, half + 1):
            top = pair_k[..., :half].topk(pairs, -1).indices
            keep = torch.zeros_like(pair_k, dtype=torch.bool)
            keep.scatter_(-1, top, True)
            keep.scatter_(-1, top + half, True)
            SCALES[(li, "outl", pairs)] = keep.unsqueeze(2)
        pair_q = eq[:, :, 0] + eq[:, :, 0].roll(half, -1)
        imp = (pair_q * pair_k).sqrt()
        for pairs in range(1, half):
            top = imp[..., :half].topk(pairs, -1).indices
            keep = torch.zeros_like(imp, dtype=torch.bool)
            keep.scatter_(-1, top, True)
            keep.scatter_(-1, top + half, True)
            SCALES[(li, "imp", pairs)] = keep.unsqueeze(2)
        for centred in (False, "k", "r"):
            kc = {False: k, "k": k - SCALES[(li, "kmean")], "r": k_pre - SCALES[(li, "rmean")]}[centred]
            ek = kc.pow(2).mean(2, keepdim=True)
            for pair in (False, True):
                # pair: one scale per rotary pair (c, c + d/2), transformers' channel order.
                e_q, e_k = (x + x.roll(x.shape[-1] // 2, -1) if pair else x for x in (eq, ek))
                SCALES[(li, 1, centred, pair)] = (e_q.clamp_min(1e-8) / e_k.clamp_min(1e-8)).pow(0.25)
                SCALES[(li, 2, centred, pair)] = e_k.clamp_min(1e-8).pow(-0.25)

    ids = tok(open(text).read(), return_tensors="pt").input_ids[:, :n]

    def score():
        with torch.no_grad():
            logits = model(ids).logits[0]
        lp = torch.log_softmax(logits[:-1].float(), -1)
        return math.exp(-lp.gather(1, ids[0, 1:, None]).mean().item()), lp

    base, base_lp = score()
    print(f"{ids.shape[1]} tokens; unquantized perplexity {base:.4f}")
    for spec in sys.argv[5:]:
        SETTING.clear()
        SETTING.update(eval(f"dict({spec})"))
        ppl, lp = score()
        agree = (lp.argmax(-1) == base_lp.argmax(-1)).float().mean().item() * 100
        # KL(unquantized || quantized) per position: far less noisy than a perplexity ratio.
        kl = (base_lp.exp() * (base_lp - lp)).sum(-1).mean().item()
        print(f"{spec:40s} perplexity {ppl:.4f} ({(ppl / base - 1) * 100:+.2f}%), top-1 agreement {agree:.1f}%, "
              f"KL {kl:.4f}", flush=True)


if __name__ == "__main__":
    main()
