#!/usr/bin/env python3
"""Fixtures for Qwen3.5 MTP (multi-token prediction) drafting, with a reference from transformers' classes.

    tests/fixtures/tiny-qwen3.5-mtp/       tiny-qwen3.5 (shard 1, unchanged) + a trained MTP head
                                           (`mtp.*`, shard 2), `mtp_num_hidden_layers: 1`
    tests/fixtures/tiny-qwen3.5-moe-mtp/   tiny-qwen3.5-moe (VLM layout) + an MoE MTP head, top-level
                                           `mtp.*` keys (as real Qwen3.5 VLM checkpoints store them)
    tests/fixtures/mlx/qwen3.5-mtp-4bit/   mlx-vlm's 4-bit conversion of tiny-qwen3.5-mtp (main model,
                                           with two per-layer overrides) + the MTP head quantized by
                                           mx.quantize in a sidecar `model-mtp.safetensors`

Each head starts random (seeded) and is trained for a few seconds (train_head: self-distillation of
draft 1 and the chained draft 2 on the target's greedy continuations of TRAIN["prompts"] random prompts
plus the reference tokens, stopped once the training prompts' position-1 acceptance reaches
TRAIN["stop_at"]), so engine tests see accepted and rejected drafts on those prompts (listed in
reference_mtp.json `training.train_sequences`). The tiny random targets are chaotic: on held-out random
prompts acceptance stays ~0.5% (in `acceptance`), so test on the training prompts.

The MTP head, for the pair (h_p, t_{p+1}) at position p (h_p = the target's post-final-norm hidden
state, E = the shared embedding, no scaling):

    x   = fc(concat(pre_fc_norm_embedding(E[t_{p+1}]), pre_fc_norm_hidden(h_p)))   # embedding first
    x   = full-attention decoder layer (mtp.layers.0), position p, causal over pairs 0..p
    m_p = mtp.norm(x);  logits = lm_head(m_p)  (tied: m_p E^T)

`reference_mtp.safetensors` in each directory: `tokens` i64 [N], `hidden` f32 [N, H] (the target's
post-norm hidden states over `tokens`, positions 0..N-1), `mtp_hidden` f32 [N-1, H] (m_p) and
`mtp_logits` f32 [N-1, V] for the pairs (hidden[p], tokens[p+1]), p = 0..N-2. The head is built from
transformers' own classes (the family's decoder layer for a full-attention index, its RMSNorm, its
rotary embedding with 3 equal M-RoPE rows, transformers' causal mask); only concat + fc is by hand.
The script asserts that this wiring, given the main model's layer 3 weights, reproduces the main
model's layer 3 output on the same input. The MLX fixture's reference takes `hidden` from mlx-vlm's
forward of the quantized main model and computes the head in torch with every quantized MTP matrix
(and the quantized tied embedding) replaced by mx.dequantize; mlx-vlm's own MTP drafter
(Qwen3_5MTPDraftModel) is run on every fixture as a cross-check (reference_mtp.json `checks`).

Needs both venvs (the MLX part runs in a subprocess with mlx):

    flock /work/build.lock /work/venv-torch/bin/python scripts/make_mtp_fixtures.py \
        [--mlx-python /work/venv-mlx/bin/python]          # ~1-2 min on 2 cores, offline; byte-identical on rerun
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIX = os.path.join(REPO, "tests", "fixtures")
MLX_NAME = "qwen3.5-mtp-4bit"

# MTP norms that follow Qwen3.5's (1+w) convention in HF checkpoints (MLX stores 1+w).
NORM_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                 "k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                 "mtp.norm.weight")

# MLX quantization of the MTP head: global 4-bit group 64 (every input dim is 64 or 128) and
# per-module overrides keyed by the sidecar's module path (`mtp.` + the drafter's path, which is
# how mlx-vlm's Qwen3_5MTPSplitter reads MTP overrides from a base config).
MTP_OVERRIDES = {
    "mtp.fc": {"group_size": 64, "bits": 8},
    "mtp.layers.0.self_attn.v_proj": {"group_size": 32, "bits": 8},
    "mtp.layers.0.mlp.down_proj": {"group_size": 64, "bits": 6},
}
# Main-model overrides (mlx-vlm writes them keyed with the VLM wrapper prefix).
MAIN_OVERRIDES = {
    "language_model.model.layers.3.self_attn.v_proj": {"group_size": 32, "bits": 8},
    "language_model.model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 6},
}
GLOBAL_Q = {"group_size": 64, "bits": 4}

# The MTP head is trained briefly (self-distillation, see train_head) so that its greedy drafts are
# accepted often enough for engine tests to see both accepted and rejected drafts.
PROMPT_LEN, N_NEW = (3, 40), 24  # random-token prompts, greedy continuation length
TRAIN = {"prompts": 64, "heldout_prompts": 64, "max_steps": 600, "stop_at": 0.6, "lr": 3e-3, "chain_weight": 0.5,
         "prompt_seed": 1000, "heldout_seed": 2000}


def is_norm(key):
    return any(key.endswith(s) for s in NORM_SUFFIXES)


def chmod_files(d):
    """save_file writes 0600; the other fixtures are 0644."""
    for f in os.listdir(d):
        os.chmod(os.path.join(d, f), 0o644)


def write_json(path, obj, indent=2, sort_keys=True):
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=indent, sort_keys=sort_keys, ensure_ascii=False)
        fh.write("\n")


# ================================================================================================
# torch side
# ================================================================================================

def torch_main(args):
    sys.path.insert(0, HERE)
    import make_fixtures as mf  # noqa: F401  (offline switches)
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers.masking_utils import create_causal_mask

    torch.set_num_threads(2)

    def load_shard_keys(path):
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    class MtpHead(torch.nn.Module):
        """The MTP head from the family's own classes; only concat + fc is written here."""

        def __init__(self, tcfg, layer_cls, norm_cls, rope_cls):
            super().__init__()
            h, eps = tcfg.hidden_size, tcfg.rms_norm_eps
            self.tcfg = tcfg
            self.pre_fc_norm_embedding = norm_cls(h, eps=eps)
            self.pre_fc_norm_hidden = norm_cls(h, eps=eps)
            self.fc = torch.nn.Linear(2 * h, h, bias=False)
            full = list(tcfg.layer_types).index("full_attention")  # a full-attention index (3)
            self.layer = layer_cls(tcfg, full)
            assert self.layer.block_type == "full_attention"
            self.norm = norm_cls(h, eps=eps)
            self.rotary = rope_cls(config=tcfg)

        def load(self, mtp):
            """`mtp.*` tensors (HF layout, per-expert MoE weights) into the modules."""
            sd = {}
            experts = {}
            for k, v in mtp.items():
                assert k.startswith("mtp."), k
                k = k[len("mtp."):]
                if k.startswith("layers.0.mlp.experts."):
                    _, _, _, _, e, proj, _ = k.split(".")
                    experts.setdefault(proj, {})[int(e)] = v
                    continue
                sd[k.replace("layers.0.", "layer.", 1) if k.startswith("layers.0.") else k] = v
            if experts:
                n = len(experts["gate_proj"])
                # transformers' fused layout: gate_up_proj [E, 2I, H] (gate rows first), down [E, H, I]
                sd["layer.mlp.experts.gate_up_proj"] = torch.stack(
                    [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]], 0) for e in range(n)])
                sd["layer.mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(n)])
            self.load_state_dict(sd, strict=True)
            return self

        def decoder(self, x, positions):
            """The decoder layer over x [1, T, H] at `positions` [T], causal."""
            pos = positions.view(1, 1, -1).expand(3, 1, -1)  # M-RoPE, text: the 3 rows equal
            pe = self.rotary(x, pos)
            mask = create_causal_mask(config=self.tcfg, inputs_embeds=x, attention_mask=None, cache=None,
                                      position_ids=positions[None])
            return self.layer(x, position_embeddings=pe, attention_mask=mask, position_ids=positions[None])

        def forward(self, emb, hidden, positions):
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], -1))
            return self.norm(self.decoder(x, positions))

        def layer_masked(self, x, positions, allowed):
            """The decoder layer over x [B, T, H] at `positions` [T] with the boolean mask `allowed` [T, T]."""
            b = x.shape[0]
            pe = self.rotary(x, positions.view(1, 1, -1).expand(3, b, -1))
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            return self.layer(x, position_embeddings=pe, attention_mask=mask[None, None],
                              position_ids=positions[None].expand(b, -1))

        def chained(self, embed, ids, hidden):
            """Drafts 1 and 2 for every pair, in two passes (B sequences, right-padded: causal).

            Draft 1 at pair p: (hidden[p], ids[p+1]) at position p, over pairs 0..p -> m1[p] (for ids[p+2]).
            Draft 2 chains it: (m1[p], ids[p+2]) at position p+1, over pairs 0..p and itself -> m2[p]
            (for ids[p+3]); the token is the true ids[p+2], which is draft 1 whenever draft 1 is accepted."""
            t = ids.shape[1] - 1
            x1 = self.fc(torch.cat([self.pre_fc_norm_embedding(embed[ids[:, 1:]]),
                                    self.pre_fc_norm_hidden(hidden[:, :-1])], -1))
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            m1 = self.norm(self.layer_masked(x1, torch.arange(t), causal))
            x2 = self.fc(torch.cat([self.pre_fc_norm_embedding(embed[ids[:, 2:]]),
                                    self.pre_fc_norm_hidden(m1[:, :-1])], -1))
            allowed = torch.zeros(2 * t - 1, 2 * t - 1, dtype=torch.bool)
            allowed[:t, :t] = causal
            allowed[t:, :t - 1] = causal[:t - 1, :t - 1]  # chained pair p sees pairs 0..p ...
            allowed[t:, t:] = torch.eye(t - 1, dtype=torch.bool)  # ... and itself
            pos = torch.cat([torch.arange(t), torch.arange(1, t)])
            m2 = self.norm(self.layer_masked(torch.cat([x1, x2], 1), pos, allowed)[:, t:])
            return m1, m2

        def export(self):
            """The modules' weights as `mtp.*` tensors in the HF layout (per-expert MoE weights)."""
            out = {}
            for k, v in self.state_dict().items():
                v = v.detach().clone().contiguous()
                if k == "layer.mlp.experts.gate_up_proj":
                    i = v.shape[1] // 2
                    for e in range(v.shape[0]):
                        out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = v[e, :i].clone()
                        out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = v[e, i:].clone()
                elif k == "layer.mlp.experts.down_proj":
                    for e in range(v.shape[0]):
                        out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = v[e].clone()
                else:
                    out["mtp." + (k.replace("layer.", "layers.0.", 1) if k.startswith("layer.") else k)] = v
            return out

        def stepped_chain(self, embed, ids, hidden, p):
            """Draft 2 at pair p the decode way: pairs 0..p one at a time into a DynamicCache, then
            (m_p, ids[p+2]) at position p+1."""
            from transformers import DynamicCache
            cache = DynamicCache()

            def step(e, h, q):
                x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(h)], -1))
                pos = torch.tensor([q])
                pe = self.rotary(x, pos.view(1, 1, -1).expand(3, 1, -1))
                return self.norm(self.layer(x, position_embeddings=pe, attention_mask=None,
                                            position_ids=pos[None], cache=cache))
            for q in range(p + 1):
                m = step(embed[ids[q + 1]][None, None], hidden[q][None, None], q)
            return step(embed[ids[p + 2]][None, None], m, p + 1)[0, 0]

        def stepped(self, emb, hidden):
            """Pair by pair with transformers' DynamicCache (decode form), positions 0, 1, ..."""
            from transformers import DynamicCache
            cache = DynamicCache()
            rows = []
            for p in range(emb.shape[1]):
                x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb[:, p:p + 1]),
                                       self.pre_fc_norm_hidden(hidden[:, p:p + 1])], -1))
                pos = torch.tensor([p])
                pe = self.rotary(x, pos.view(1, 1, -1).expand(3, 1, -1))
                x = self.layer(x, position_embeddings=pe, attention_mask=None, position_ids=pos[None],
                               cache=cache)
                rows.append(self.norm(x))
            return torch.cat(rows, 1)

    def family(kind):
        if kind == "dense":
            from transformers.models.qwen3_5 import modeling_qwen3_5 as m
            return (transformers.Qwen3_5ForCausalLM, m.Qwen3_5DecoderLayer, m.Qwen3_5RMSNorm,
                    m.Qwen3_5TextRotaryEmbedding)
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        return (transformers.Qwen3_5MoeForConditionalGeneration, m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm,
                m.Qwen3_5MoeTextRotaryEmbedding)

    def text_model(model):
        return model.model.language_model if hasattr(model.model, "language_model") else model.model

    def random_mtp(main, lm, hidden_size, seed):
        """Random MTP tensors named after the main full-attention layer 3, initialised like the model
        (matrices N(0, initializer_range 0.2), (1+w) norms 0) plus N(0, 0.1) on every 1-D norm."""
        src = f"{lm}layers.3."
        shapes = {"mtp.layers.0." + k[len(src):]: tuple(v.shape) for k, v in main.items() if k.startswith(src)}
        shapes["mtp.fc.weight"] = (hidden_size, 2 * hidden_size)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            shapes[f"mtp.{n}.weight"] = (hidden_size,)
        gen = torch.Generator().manual_seed(seed)
        out = {}
        for k in sorted(shapes):
            s = shapes[k]
            if len(s) == 1:
                assert is_norm(k), k
                out[k] = torch.randn(s, generator=gen) * 0.1
            else:
                out[k] = torch.randn(s, generator=gen) * 0.2
        return out

    def write_index(path, files):
        wm, total = {}, 0
        for fname, tensors in files:
            for k, v in tensors.items():
                wm[k] = fname
                total += v.numel() * v.element_size()
        write_json(path, {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))})

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    def random_prompts(n, seed, vocab):
        """n prompts of random token ids, lengths PROMPT_LEN."""
        gen = torch.Generator().manual_seed(seed)
        lens = torch.randint(PROMPT_LEN[0], PROMPT_LEN[1] + 1, (n,), generator=gen)
        return [torch.randint(0, vocab, (int(n),), generator=gen) for n in lens]

    def greedy_batch(tm, lm_head, prompts):
        """The target's greedy continuations (N_NEW tokens) of `prompts`, batched right-padded (causal:
        the padding never reaches a real position), and its hidden states over the result.
        Returns ids [B, L] (pad 0), prompt lengths [B], hidden [B, L, H]."""
        lens = torch.tensor([len(q) for q in prompts])
        ids = torch.zeros(len(prompts), int(lens.max()) + N_NEW, dtype=torch.int64)
        for i, q in enumerate(prompts):
            ids[i, :len(q)] = q
        rows, cur = torch.arange(len(prompts)), lens.clone()
        with torch.no_grad():
            for _ in range(N_NEW):
                h = tm(input_ids=ids[:, :int(cur.max())]).last_hidden_state
                ids[rows, cur] = lm_head(h[rows, cur - 1]).argmax(-1)
                cur += 1
            hidden = tm(input_ids=ids).last_hidden_state
        return ids, lens, hidden

    def draft_masks(ids, lens, first):
        """Pairs p (rows of m1 / m2) whose draft targets are continuation tokens: p >= P - first
        (first = 2: the pair that predicts the first generated token, for training; 1: the first draft
        a decoder makes, after prefill), and ids[p+2] (draft 1) / ids[p+3] (draft 2) inside the sequence."""
        t = ids.shape[1] - 1
        p = torch.arange(t)[None]
        start, end = (lens - first)[:, None], (lens + N_NEW)[:, None]  # end: sequence length
        return ((p >= start) & (p + 2 < end))[:, :t - 1], ((p >= start) & (p + 3 < end))[:, :t - 2]

    def acceptance(head, embed, ids, lens, hidden):
        """Greedy acceptance of drafts 1 and 2 against the target's own greedy tokens, from the first
        draft after prefill: position 1 (draft 1 = ids[p+2]), position 2 (both drafts accepted) and
        position 2 given position 1."""
        with torch.no_grad():
            m1, m2 = head.chained(embed, ids, hidden)
            d1, d2 = (m1[:, :-1] @ embed.T).argmax(-1), (m2[:, :-1] @ embed.T).argmax(-1)
        v1, v2 = draft_masks(ids, lens, 1)
        ok1 = d1 == ids[:, 2:]
        ok2 = ok1[:, :-1] & (d2 == ids[:, 3:])
        a1 = float(ok1[v1].float().mean())
        a2 = float(ok2[v2].float().mean())
        return {"position_1": round(a1, 4), "position_2": round(a2, 4),
                "position_2_given_1": round(float(ok2[v2].sum() / ok1[:, :-1][v2].sum()), 4),
                "drafts_1": int(v1.sum()), "drafts_2": int(v2.sum())}

    def train_head(head, embed, ids, lens, hidden):
        """Self-distillation: cross-entropy of draft 1 (pair p -> ids[p+2]) and of the chained draft 2
        (-> ids[p+3]) to the target's greedy continuation tokens; full batch, Adam; the target (hidden
        states, embedding = tied LM head) frozen. Stops once the training prompts' position-1 acceptance
        reaches TRAIN["stop_at"] (checked every 10 steps), so that their drafts are partly rejected."""
        v1, v2 = draft_masks(ids, lens, 2)
        opt = torch.optim.Adam([q for q in head.parameters()], lr=TRAIN["lr"])
        for step in range(TRAIN["max_steps"]):
            if step % 10 == 0 and acceptance(head.eval(), embed, ids, lens, hidden)["position_1"] >= TRAIN["stop_at"]:
                break
            head.train()
            m1, m2 = head.chained(embed, ids, hidden)
            loss = (torch.nn.functional.cross_entropy((m1[:, :-1] @ embed.T)[v1], ids[:, 2:][v1])
                    + TRAIN["chain_weight"] * torch.nn.functional.cross_entropy((m2[:, :-1] @ embed.T)[v2],
                                                                                ids[:, 3:][v2]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        head.eval()
        return step, float(loss.detach())

    def training_info(steps, final_loss, train):
        return {"method": "self-distillation: cross-entropy of draft 1 (pair p -> t_{p+2}) and of the chained "
                          "draft 2 ((m_p, t_{p+2}) at position p+1 -> t_{p+3}, weight chain_weight) to the "
                          "target's own greedy tokens, pairs from the one predicting the first generated "
                          "token on; full batch, Adam, only mtp.* trained (target, tied embedding frozen), "
                          "from the random init; stops at the first multiple of 10 steps where the training "
                          "prompts' position-1 acceptance is >= stop_at",
                "prompt_len": list(PROMPT_LEN), "continuation": N_NEW,
                **TRAIN, "steps": steps, "final_loss": round(final_loss, 4),
                "train_sequences": [{"prompt": " ".join(map(str, ids[:n].tolist())),
                                     "continuation": " ".join(map(str, ids[n:n + N_NEW].tolist()))}
                                    for ids, n in zip(train[0], train[1].tolist())],
                "acceptance_defs": "greedy; over the drafts a decoder makes (from the first draft after "
                                   "prefill); position_1: draft 1 == target's token; position_2: drafts 1 "
                                   "and 2 both accepted; position_2_given_1: position_2 / position_1 over "
                                   "the same drafts; train: train_sequences (the first prompt is the source "
                                   "reference's tokens, the rest random from prompt_seed + seed); heldout: "
                                   "random prompts from heldout_seed + seed"}

    def make(kind, seed):
        import time
        t0 = time.time()
        src_name = "tiny-qwen3.5" if kind == "dense" else "tiny-qwen3.5-moe"
        name = src_name + "-mtp"
        src, out = os.path.join(FIX, src_name), os.path.join(FIX, name)
        lm = "model." if kind == "dense" else "model.language_model."
        causal_cls, layer_cls, norm_cls, rope_cls = family(kind)

        if os.path.exists(out):
            shutil.rmtree(out)
        os.makedirs(out)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
        with open(os.path.join(src, "config.json")) as fh:
            cfg = json.load(fh)
        (cfg["text_config"] if "text_config" in cfg else cfg)["mtp_num_hidden_layers"] = 1
        write_json(os.path.join(out, "config.json"), cfg)
        shard1 = "model-00001-of-00002.safetensors"
        shard2 = "model-00002-of-00002.safetensors"
        shutil.copyfile(os.path.join(src, "model.safetensors"), os.path.join(out, shard1))  # byte-identical
        main = load_shard_keys(os.path.join(out, shard1))
        hidden_size = main[lm + "embed_tokens.weight"].shape[1]
        mtp = random_mtp(main, lm, hidden_size, seed)
        save_file(mtp, os.path.join(out, shard2), metadata={"format": "pt"})
        write_index(os.path.join(out, "model.safetensors.index.json"), [(shard1, main), (shard2, mtp)])

        # ---- the target, reloaded from disk (transformers skips `mtp.*` on load)
        model = causal_cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
        tm = text_model(model)
        tcfg = tm.config
        src_ref = load_file(os.path.join(src, "reference.safetensors"))
        tokens = src_ref["text.input_ids"].to(torch.int64)
        n = tokens.shape[0]
        seen = {}

        def hook(mod, a, kw, o):
            seen["in"], seen["out"] = a[0].detach().clone(), o.detach().clone()
        hnd = tm.layers[3].register_forward_hook(hook, with_kwargs=True)
        with torch.no_grad():
            hidden = tm(input_ids=tokens[None]).last_hidden_state[0]
            logits = model.lm_head(hidden)
        hnd.remove()
        # the same target as the source fixture's reference (made with another torch build: ~4e-5 abs)
        d_src = rel(logits, src_ref["text.logits"])
        assert d_src < 1e-4, d_src

        # ---- self-check: the MTP wiring with the main layer 3's weights gives the main layer 3's output
        as_mtp = {"mtp.layers.0." + k[len(f"{lm}layers.3."):]: v for k, v in main.items()
                  if k.startswith(f"{lm}layers.3.")}
        as_mtp.update({k: v for k, v in mtp.items() if not k.startswith("mtp.layers.")})
        chk = MtpHead(tcfg, layer_cls, norm_cls, rope_cls).load(as_mtp).eval()
        with torch.no_grad():
            y = chk.decoder(seen["in"], torch.arange(n))
        d_layer3 = float((y - seen["out"]).abs().max())
        assert d_layer3 < 1e-6, d_layer3

        # ---- training (self-distillation on the target's greedy continuations), then shard 2 again
        embed = tm.embed_tokens.weight.detach()
        head = MtpHead(tcfg, layer_cls, norm_cls, rope_cls).load(mtp)
        vocab = embed.shape[0]
        # the training prompts: the source reference's tokens, then random ones
        train = greedy_batch(tm, model.lm_head, [tokens] + random_prompts(TRAIN["prompts"],
                                                                          seed + TRAIN["prompt_seed"], vocab))
        held = greedy_batch(tm, model.lm_head, random_prompts(TRAIN["heldout_prompts"], seed + TRAIN["heldout_seed"],
                                                              vocab))
        accept = {"random_init_heldout": acceptance(head.eval(), embed, *held)}
        steps, final_loss = train_head(head, embed, *train)
        mtp = head.export()
        assert sorted(mtp) == sorted(random_mtp(main, lm, hidden_size, seed)), "export keys"
        save_file(mtp, os.path.join(out, shard2), metadata={"format": "pt"})
        write_index(os.path.join(out, "model.safetensors.index.json"), [(shard1, main), (shard2, mtp)])
        # the figures from the head as saved
        saved = MtpHead(tcfg, layer_cls, norm_cls, rope_cls).load(load_shard_keys(os.path.join(out, shard2))).eval()
        accept["train"] = acceptance(saved, embed, *train)
        accept["heldout"] = acceptance(saved, embed, *held)
        print(f"{name}: steps {steps} loss {final_loss:.4f} acceptance {accept} ({time.time() - t0:.1f} s)", flush=True)

        # ---- the reference
        head = MtpHead(tcfg, layer_cls, norm_cls, rope_cls).load(load_shard_keys(os.path.join(out, shard2))).eval()
        emb_table = tm.embed_tokens.weight
        assert model.lm_head.weight.data_ptr() == emb_table.data_ptr()  # tied
        with torch.no_grad():
            emb = emb_table[tokens[1:]][None]
            m = head(emb, hidden[None, :-1], torch.arange(n - 1))[0]
            mtp_logits = m @ emb_table.T
            m_step = head.stepped(emb, hidden[None, :-1])[0]
            _, m2 = head.chained(emb_table, tokens[None], hidden[None])
            d_chain = max(float((head.stepped_chain(emb_table, tokens, hidden, p) - m2[0, p]).abs().max())
                          for p in (0, n // 2, n - 3))
        ref = {"tokens": tokens.contiguous(), "hidden": hidden.contiguous(), "mtp_hidden": m.contiguous(),
               "mtp_logits": mtp_logits.contiguous()}
        checks = {
            "chained_draft2_two_pass_vs_stepped_dynamic_cache_max_abs_diff": d_chain,
            "target_logits_vs_source_reference_max_rel_diff": d_src,
            "self_check_layer3_weights_vs_main_layer3_output_max_abs_diff": d_layer3,
            "stepped_with_dynamic_cache_vs_causal_pass_mtp_hidden_max_abs_diff": float((m_step - m).abs().max()),
        }
        return out, ref, checks, {"kind": kind, "seed": seed, "source": f"tests/fixtures/{src_name}",
                                  "hidden_size": hidden_size, "n_mtp_tensors": len(mtp),
                                  "training": training_info(steps, final_loss, train), "acceptance": accept}, (train, held)

    def save_ref(out, ref, info):
        save_file(ref, os.path.join(out, "reference_mtp.safetensors"),
                  metadata={"generator": f"scripts/make_mtp_fixtures.py transformers={transformers.__version__}"})
        info = dict(info)
        info["keys"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(ref.items())}
        info["greedy_draft_tokens"] = ref["mtp_logits"].argmax(-1).tolist()
        top2 = ref["mtp_logits"].topk(2, -1).values
        info["min_top1_top2_margin"] = float((top2[:, 0] - top2[:, 1]).min())
        info["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
        write_json(os.path.join(out, "reference_mtp.json"), info, indent=1)
        chmod_files(out)

    results = {}
    held = {}
    for kind, seed in (("dense", 360), ("moe", 361)):
        out, ref, checks, info, held[kind] = make(kind, seed)
        results[kind] = (out, ref, checks, info)
        print(f"{os.path.basename(out)}: N={ref['tokens'].shape[0]} checks={checks}", flush=True)
    if args.train_only:
        return

    # ---- MLX: conversion, sidecar, mlx hidden states and mlx-vlm's drafter, in the mlx venv
    with tempfile.TemporaryDirectory() as tmp:
        xfer_in = os.path.join(tmp, "to_mlx.safetensors")
        xfer = {}
        for kind, (out, ref, _, _) in results.items():
            xfer[f"{kind}.tokens"] = ref["tokens"]
            xfer[f"{kind}.hidden"] = ref["hidden"]
        save_file(xfer, xfer_in)
        xfer_out = os.path.join(tmp, "from_mlx.safetensors")
        subprocess.run([args.mlx_python, os.path.abspath(__file__), "--mlx-part", xfer_in, xfer_out, tmp],
                       check=True)
        back = load_file(xfer_out)
        with open(xfer_out + ".json") as fh:
            mlx_info = json.load(fh)

    # mlx-vlm's drafter on the float fixtures (HF layout through its sanitize: norm shift, expert stacking)
    for kind, (out, ref, checks, info) in results.items():
        checks["mlx_vlm_drafter_vs_reference_mtp_logits_max_rel_diff"] = rel(back[f"{kind}.mlx_logits"],
                                                                           ref["mtp_logits"])
        checks["mlx_vlm_drafter_vs_reference_mtp_hidden_max_abs_diff"] = float(
            (back[f"{kind}.mlx_hidden"] - ref["mtp_hidden"]).abs().max())
        assert checks["mlx_vlm_drafter_vs_reference_mtp_logits_max_rel_diff"] < 1e-4, checks
        info["checks"] = checks
        save_ref(out, ref, info)

    # the MLX fixture's reference: torch head with the dequantized MTP matrices and embedding
    out = os.path.join(FIX, "mlx", MLX_NAME)
    _, layer_cls, norm_cls, rope_cls = family("dense")
    tcfg = transformers.AutoConfig.from_pretrained(os.path.join(FIX, "tiny-qwen3.5-mtp"))
    tcfg._attn_implementation = "eager"
    mtp = {k[len("dq."):]: v for k, v in back.items() if k.startswith("dq.mtp.")}
    head = MtpHead(tcfg, layer_cls, norm_cls, rope_cls).load(mtp).eval()
    tokens, hidden, emb_table = back["mlx.tokens"], back["mlx.hidden"], back["dq.embed_tokens"]
    with torch.no_grad():
        emb = emb_table[tokens[1:]][None]
        m = head(emb, hidden[None, :-1], torch.arange(tokens.shape[0] - 1))[0]
        mtp_logits = m @ emb_table.T
        m_step = head.stepped(emb, hidden[None, :-1])[0]
    ref = {"tokens": tokens.contiguous(), "hidden": hidden.contiguous(), "mtp_hidden": m.contiguous(),
           "mtp_logits": mtp_logits.contiguous()}
    checks = dict(mlx_info["checks"])
    checks["stepped_with_dynamic_cache_vs_causal_pass_mtp_hidden_max_abs_diff"] = float((m_step - m).abs().max())
    checks["mlx_vlm_drafter_quantized_vs_reference_mtp_logits_max_rel_diff"] = rel(back["mlx.mlx_logits"], mtp_logits)
    checks["mlx_vlm_drafter_quantized_vs_reference_mtp_hidden_max_abs_diff"] = float(
        (back["mlx.mlx_hidden"] - m).abs().max())
    assert checks["mlx_vlm_drafter_quantized_vs_reference_mtp_logits_max_rel_diff"] < 1e-4, checks
    info = dict(mlx_info["info"])
    info["checks"] = checks
    # the quantized head against the FLOAT target's greedy sequences (the quantized target's own greedy
    # continuations differ; these figures show what quantizing the head costs)
    info["acceptance_dequantized_head_on_float_target_sequences"] = {
        "train": acceptance(head, emb_table, *held["dense"][0]),
        "heldout": acceptance(head, emb_table, *held["dense"][1])}
    print(f"mlx/{MLX_NAME}: acceptance {info['acceptance_dequantized_head_on_float_target_sequences']}")
    save_ref(out, ref, info)
    print(f"mlx/{MLX_NAME}: N={tokens.shape[0]} checks={checks}", flush=True)


# ================================================================================================
# mlx side (run in the mlx venv by torch_main)
# ================================================================================================

def mlx_part(xfer_in, xfer_out, tmp):
    from pathlib import Path

    import numpy as np
    import mlx.core as mx
    import mlx.nn as nn
    from safetensors.numpy import load_file, save_file

    sys.path.insert(0, HERE)
    import make_mlx_fixtures as mm
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    mx.set_default_device(mx.cpu)
    tmp = Path(tmp)
    xin = load_file(xfer_in)
    back, checks = {}, {}

    def drafter(config, weights, quant=None):
        """mlx-vlm's own Qwen3.5 MTP draft model with `weights` (its key names, no `mtp.`)."""
        d = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict({"text_config": config.get("text_config", config)}))
        if quant is not None:
            def pred(path, module):
                if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
                    return False
                return quant.get("mtp." + path, True)
            nn.quantize(d, group_size=quant["group_size"], bits=quant["bits"], mode="affine", class_predicate=pred)
        d.load_weights(list(weights.items()), strict=True)
        mx.eval(d.parameters())
        return d

    def run_drafter(d, embed, tokens, hidden):
        """The pairs (hidden[p], tokens[p+1]) at positions 0..N-2 in one causal pass."""
        emb = embed(mx.array(tokens[1:])[None])
        n = tokens.shape[0] - 1
        h = d._forward_hidden(emb, mx.array(hidden[:-1])[None], None, mx.arange(n)[None])
        return np.array(h[0]), np.array(embed.as_linear(h)[0])

    # ---- mlx-vlm's drafter on the two float fixtures (HF layout, through its own sanitize)
    for kind, name, lm in (("dense", "tiny-qwen3.5-mtp", "model."), ("moe", "tiny-qwen3.5-moe-mtp",
                                                                      "model.language_model.")):
        d = mm.FIX / name
        config = json.loads((d / "config.json").read_text())
        raw = mx.load(str(d / "model-00002-of-00002.safetensors"))
        model = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict(
            {"text_config": config.get("text_config", config)}))
        dr = drafter(config, model.sanitize(raw))
        e = mx.load(str(d / "model-00001-of-00002.safetensors"))[lm + "embed_tokens.weight"]
        embed = nn.Embedding(*e.shape)
        embed.weight = e
        h, lg = run_drafter(dr, embed, xin[f"{kind}.tokens"], xin[f"{kind}.hidden"])
        back[f"{kind}.mlx_hidden"], back[f"{kind}.mlx_logits"] = h, lg

    # ---- the conversion: mlx-vlm, as qwen3.5-4bit (4-bit g64), plus two main-model overrides
    def predicate(path, module):
        from mlx_vlm.utils import skip_multimodal_module
        if skip_multimodal_module(path):
            return False
        return MAIN_OVERRIDES.get(path, True)

    src = mm.FIX / "tiny-qwen3.5-mtp"
    dst = mm.OUT / MLX_NAME
    staged = mm.stage(src, tmp / "stage-mtp")
    if dst.exists():
        shutil.rmtree(dst)
    spec = dict(name=MLX_NAME, src="tiny-qwen3.5-mtp", conv="vlm", bits=GLOBAL_Q["bits"],
                group=GLOBAL_Q["group_size"], predicate=predicate)
    mm.convert(spec, staged, dst)
    main_w = load_file(str(dst / "model.safetensors"))
    assert not any("mtp" in k for k in main_w), "mlx-vlm kept mtp tensors"

    # ---- the sidecar: `mtp.*`, norms shifted to MLX's plain-w (1 + w_hf), matrices quantized
    hf = load_file(str(src / "model-00002-of-00002.safetensors"))
    side, dq = {}, {}
    quantized = {}
    for k in sorted(hf):
        v = hf[k]
        if v.ndim == 1:
            assert is_norm(k), k
            s = (mx.array(v) + 1.0).astype(mx.float32)
            side[k] = np.array(s)
            dq[k] = np.array(s - 1.0)  # exact: the torch (1+w) norm then multiplies by the stored value
            continue
        mod = k[: -len(".weight")]
        q = MTP_OVERRIDES.get(mod, GLOBAL_Q)
        wq, sc, bi = mx.quantize(mx.array(v), group_size=q["group_size"], bits=q["bits"], mode="affine")
        side[k], side[mod + ".scales"], side[mod + ".biases"] = np.array(wq), np.array(sc), np.array(bi)
        dq[k] = np.array(mx.dequantize(wq, sc, bi, group_size=q["group_size"], bits=q["bits"], mode="affine"))
        quantized[mod] = {"bits": q["bits"], "group_size": q["group_size"], "weight": list(wq.shape),
                          "scales": list(sc.shape), "source": list(v.shape), "override": mod in MTP_OVERRIDES,
                          "max_abs_dequant_err": float(np.abs(dq[k] - v).max())}
    save_file(side, str(dst / "model-mtp.safetensors"), metadata={"format": "mlx"})

    # index and config: the sidecar's keys, and its overrides next to the main model's
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    for k, v in side.items():
        idx["weight_map"][k] = "model-mtp.safetensors"
        idx["metadata"]["total_size"] += int(v.nbytes)
    idx["weight_map"] = dict(sorted(idx["weight_map"].items()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx, indent=4))
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        for mod, q in MTP_OVERRIDES.items():
            cfg[key][mod] = dict(q)
    assert cfg["quantization"] == cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=4))

    # ---- the target's hidden states: mlx-vlm's forward of the quantized main model (sidecar present)
    from mlx_vlm.utils import load_model
    model = load_model(dst)
    lm = model.language_model
    tokens = xin["dense.tokens"]
    for a in ("_position_ids", "_rope_deltas"):
        setattr(lm, a, None)
    o = lm(mx.array(tokens)[None], return_hidden=True)
    hidden = o.hidden_states[-1][0]
    checks["mlx_hidden_as_linear_vs_mlx_logits_max_abs_diff"] = float(
        np.abs(np.array(lm.model.embed_tokens.as_linear(hidden)) - np.array(o.logits[0])).max())
    for a in ("_position_ids", "_rope_deltas"):
        setattr(lm, a, None)
    emb = lm.model.embed_tokens
    dq_embed = mx.dequantize(emb.weight, emb.scales, emb.biases, group_size=emb.group_size, bits=emb.bits,
                             mode="affine")
    back["mlx.tokens"], back["mlx.hidden"] = tokens, np.array(hidden)
    back["dq.embed_tokens"] = np.array(dq_embed)
    for k, v in dq.items():
        back["dq." + k] = v

    # ---- mlx-vlm's drafter with the quantized sidecar (its own quantized matmuls), bound to the target
    dw = {k[len("mtp."):]: mx.array(v) for k, v in side.items()}
    dr = drafter(cfg, dw, quant={**GLOBAL_Q, **MTP_OVERRIDES})
    h, lg = run_drafter(dr, emb, tokens, np.array(hidden))
    back["mlx.mlx_hidden"], back["mlx.mlx_logits"] = h, lg
    save_file({k: np.ascontiguousarray(v) for k, v in back.items()}, xfer_out)

    import mlx_lm
    import mlx_vlm
    info = {
        "kind": "mlx",
        "source": "tests/fixtures/tiny-qwen3.5-mtp",
        "converter": "mlx_vlm.convert.convert (main model), mx.quantize (MTP sidecar)",
        "convert_args": {"quantize": True, "q_bits": GLOBAL_Q["bits"], "q_group_size": GLOBAL_Q["group_size"],
                         "dtype": "float32", "quant_predicate": "mlx-vlm's multimodal skip + MAIN_OVERRIDES"},
        "config_quantization": cfg["quantization"],
        "mtp_sidecar": "model-mtp.safetensors: `mtp.*` keys (HF names), every matrix quantized (weight u32, "
                       "scales, biases f32), the 1-D (1+w) norms stored shifted (1 + w_hf, MLX's plain-w "
                       "convention, like the main model's norms); listed in model.safetensors.index.json",
        "mtp_quantized_modules": quantized,
        "hidden_from": "mlx-vlm's forward of the quantized main model (language_model(ids, return_hidden=True))",
        "reference_from": "torch, transformers' classes, with every quantized MTP matrix and the tied embedding "
                          "replaced by mx.dequantize (f32) and norms = stored - 1 under the (1+w) classes",
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "mlx_vlm": mlx_vlm.__version__},
    }
    with open(xfer_out + ".json", "w") as fh:
        json.dump({"checks": checks, "info": info}, fh)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--mlx-part":
        mlx_part(*sys.argv[2:5])
    else:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--mlx-python", default=os.environ.get("MLX_PYTHON", "/work/venv-mlx/bin/python"))
        ap.add_argument("--train-only", action="store_true",
                        help="stop after the float fixtures' heads (leaves the fixtures half-made)")
        torch_main(ap.parse_args())
