#!/usr/bin/env python3
"""The GLM-4.5V NextN (MTP) fixture, with a torch reference of the layer's equations.

    tests/fixtures/tiny-glm4v-moe-mtp/   tiny-glm4v-moe (its model.safetensors as shard 1, byte-identical)
                                         + a NextN layer at `model.language_model.layers.3.*` (decoder layer
                                         index num_hidden_layers, as GLM-4.5V / GLM-4.6V store theirs at
                                         layers.46) in shard 2, bf16, listed by model.safetensors.index.json;
                                         text_config.num_nextn_predict_layers 1. Images and the image prompts'
                                         token ids are tiny-glm4v-moe's (tests read them there).

The NextN layer (DeepSeek-V3's MTP module, vLLM's glm4_moe_mtp, transformers' MtpLayer), for the pair
(h_p, t_{p+1}) at position p, h_p the target's post-final-norm hidden state, E and lm_head the target's:

    x   = eh_proj(concat(enorm(E[t_{p+1}]), hnorm(h_p)))     # embedding first
    x   = decoder layer 3 of the target's kind (attention with q/k/v bias, partial M-RoPE with the 3 rows
          equal for text, MoE: sigmoid router with correction bias, groups, a shared expert), position p,
          causal over pairs 0..p
    m_p = shared_head.norm(x);  logits = lm_head(m_p)

No position-0 mask (vLLM zeroes E[t_1] at position 0; transformers' MtpLayer does not), and the layer's own
`embed_tokens` / `shared_head.head` are not written: the target's serve (as in transformers' MtpModel).

The layer starts random (seeded, initialised like the model) and is trained for a few seconds by
self-distillation (draft 1 and the chained draft 2 against the target's greedy continuations of random
prompts plus the source's text prompt), stopped once position-1 acceptance on those prompts reaches
TRAIN["stop_at"], so engine tests see drafts both accepted and rejected on them
(`training.train_sequences` in reference_mtp.json).

reference_mtp.safetensors: `tokens` i64 [N] (training sequence 0: the source's text prompt and its greedy
continuation), `hidden` f32 [N, H] (transformers' Glm4vMoe text model, post-norm; transformers drops the
NextN weights on load), `mtp_hidden` f32 [N-1, H] (m_p) and `mtp_logits` f32 [N-1, V] for the pairs
(hidden[p], tokens[p+1]), p = 0..N-2, from the equations above written here around transformers' own
Glm4vMoeTextDecoderLayer, rotary and RMSNorm, with the stored (bf16) weights in f32. Checks (asserted,
recorded in reference_mtp.json): the wiring with the target's layer 2 weights reproduces its layer 2
output; transformers' MtpLayer with the same weights gives the same rows; a pair-by-pair pass with a
DynamicCache equals the causal pass; the target's logits equal the source fixture's reference.

    flock /work/build.lock /work/venv-torch/bin/python scripts/make_glm_nextn_fixture.py   # ~1 min, offline
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_fixtures as mf  # noqa: E402,F401  (offline switches)

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.models.glm4v_moe import modeling_glm4v_moe as glm  # noqa: E402

FIX = os.path.join(os.path.dirname(HERE), "tests", "fixtures")
SRC, NAME = "tiny-glm4v-moe", "tiny-glm4v-moe-mtp"
LM = "model.language_model."
SEED = 460
PROMPT_LEN, N_NEW, TOKEN_LIMIT = (3, 40), 24, 448  # random prompts of ids below the special tokens
TRAIN = {"prompts": 64, "heldout_prompts": 64, "max_steps": 800, "stop_at": 0.6, "lr": 3e-3, "chain_weight": 0.5,
         "prompt_seed": 1000, "heldout_seed": 2000}


def write_json(path, obj, indent=2):
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=indent, sort_keys=True, ensure_ascii=False)
        fh.write("\n")


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


class NextN(torch.nn.Module):
    """The NextN layer: its equations written here around transformers' GLM-4.5V decoder layer."""

    def __init__(self, tcfg):
        super().__init__()
        h, eps = tcfg.hidden_size, tcfg.rms_norm_eps
        self.tcfg = tcfg
        self.n = tcfg.num_hidden_layers
        self.enorm = glm.Glm4vMoeTextRMSNorm(h, eps=eps)
        self.hnorm = glm.Glm4vMoeTextRMSNorm(h, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.layer = glm.Glm4vMoeTextDecoderLayer(tcfg, self.n)
        assert isinstance(self.layer.mlp, glm.Glm4vMoeTextMoE)  # past first_k_dense_replace
        self.shared_head_norm = glm.Glm4vMoeTextRMSNorm(h, eps=eps)
        self.rotary = glm.Glm4vMoeTextRotaryEmbedding(tcfg)

    # ---- checkpoint names <-> modules
    def load(self, tensors):
        """`{LM}layers.{n}.*` tensors (HF layout, one tensor per expert) into the modules."""
        p = f"{LM}layers.{self.n}."
        sd, experts = {}, {}
        for k, v in tensors.items():
            assert k.startswith(p), k
            k = k[len(p):]
            if k.startswith("mlp.experts."):
                _, _, e, proj, _ = k.split(".")
                experts.setdefault(proj, {})[int(e)] = v.float()
            elif k.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                sd[k] = v.float()
            elif k == "shared_head.norm.weight":
                sd["shared_head_norm.weight"] = v.float()
            else:
                sd["layer." + k] = v.float()
        n = len(experts["gate_proj"])
        # transformers' fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
        sd["layer.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]], 0) for e in range(n)])
        sd["layer.mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(n)])
        self.load_state_dict(sd, strict=True)
        return self

    def export(self):
        """The modules' weights under the checkpoint's names, bf16 (as the target's)."""
        p = f"{LM}layers.{self.n}."
        out = {}
        for k, v in self.state_dict().items():
            v = v.detach().to(torch.bfloat16).contiguous()
            if k == "layer.mlp.experts.gate_up_proj":
                i = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{p}mlp.experts.{e}.gate_proj.weight"] = v[e, :i].clone()
                    out[f"{p}mlp.experts.{e}.up_proj.weight"] = v[e, i:].clone()
            elif k == "layer.mlp.experts.down_proj":
                for e in range(v.shape[0]):
                    out[f"{p}mlp.experts.{e}.down_proj.weight"] = v[e].clone()
            elif k == "shared_head_norm.weight":
                out[f"{p}shared_head.norm.weight"] = v
            else:
                out[p + k.removeprefix("layer.")] = v
        return out

    # ---- the equations
    def input(self, emb, hidden):
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], -1))

    def decoder(self, x, positions, allowed=None, cache=None):
        """The layer over x [B, T, H] at `positions` [T] (3 equal M-RoPE rows), causal unless `allowed` [T, T]."""
        b, t = x.shape[:2]
        pe = self.rotary(x, positions.view(1, 1, -1).expand(3, b, -1))
        if cache is not None:
            mask = None  # one row at a time over the cache
        else:
            allowed = torch.ones(t, t, dtype=torch.bool).tril() if allowed is None else allowed
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
        return self.layer(x, attention_mask=mask, position_ids=positions[None].expand(b, -1),
                          position_embeddings=pe, cache=cache)

    def forward(self, emb, hidden, positions):
        return self.shared_head_norm(self.decoder(self.input(emb, hidden), positions))

    def chained(self, embed, ids, hidden):
        """Drafts 1 and 2 for every pair in two passes (B right-padded sequences).
        Draft 1 at pair p: (hidden[p], ids[p+1]) at position p over pairs 0..p -> m1[p] (for ids[p+2]);
        draft 2 chains it: (m1[p], ids[p+2]) at position p+1 over pairs 0..p and itself -> m2[p] (for ids[p+3])."""
        t = ids.shape[1] - 1
        x1 = self.input(embed[ids[:, 1:]], hidden[:, :-1])
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        m1 = self.shared_head_norm(self.decoder(x1, torch.arange(t), causal))
        x2 = self.input(embed[ids[:, 2:]], m1[:, :-1])
        allowed = torch.zeros(2 * t - 1, 2 * t - 1, dtype=torch.bool)
        allowed[:t, :t] = causal
        allowed[t:, :t - 1] = causal[:t - 1, :t - 1]
        allowed[t:, t:] = torch.eye(t - 1, dtype=torch.bool)
        pos = torch.cat([torch.arange(t), torch.arange(1, t)])
        m2 = self.shared_head_norm(self.decoder(torch.cat([x1, x2], 1), pos, allowed)[:, t:])
        return m1, m2

    def stepped(self, emb, hidden):
        """Pair by pair with transformers' DynamicCache (decode form), positions 0, 1, ..."""
        cache = transformers.DynamicCache()
        rows = [self.shared_head_norm(self.decoder(self.input(emb[:, p:p + 1], hidden[:, p:p + 1]),
                                                   torch.tensor([p]), cache=cache))
                for p in range(emb.shape[1])]
        return torch.cat(rows, 1)


def random_nextn(tcfg, seed):
    """A random layer initialised like the model: matrices N(0, initializer_range), norms 1 + N(0, 0.1),
    biases and the router's correction bias N(0, 0.1)."""
    torch.manual_seed(seed)
    head = NextN(tcfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, v in head.named_parameters():
            if v.ndim >= 2:
                v.copy_(torch.randn(v.shape, generator=gen) * tcfg.initializer_range)
            elif k.endswith("norm.weight") or k.endswith("layernorm.weight"):
                v.copy_(1 + torch.randn(v.shape, generator=gen) * 0.1)
            else:
                v.copy_(torch.randn(v.shape, generator=gen) * 0.1)
        b = head.layer.mlp.gate.e_score_correction_bias
        b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return head


def random_prompts(n, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(PROMPT_LEN[0], PROMPT_LEN[1] + 1, (n,), generator=gen)
    return [torch.randint(0, TOKEN_LIMIT, (int(k),), generator=gen) for k in lens]


def greedy_batch(tm, lm_head, prompts):
    """The target's greedy continuations (N_NEW tokens), right-padded (causal: padding never reaches a real
    position), and its hidden states over them. Returns ids [B, L], prompt lengths [B], hidden [B, L, H]."""
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
    """Pairs whose draft targets are continuation tokens, from p >= P - first on (2: the pair predicting the
    first generated token, for training; 1: a decoder's first draft, after prefill)."""
    t = ids.shape[1] - 1
    p = torch.arange(t)[None]
    start, end = (lens - first)[:, None], (lens + N_NEW)[:, None]
    return ((p >= start) & (p + 2 < end))[:, :t - 1], ((p >= start) & (p + 3 < end))[:, :t - 2]


def acceptance(head, embed, lm_head, ids, lens, hidden):
    with torch.no_grad():
        m1, m2 = head.chained(embed, ids, hidden)
        d1, d2 = lm_head(m1[:, :-1]).argmax(-1), lm_head(m2[:, :-1]).argmax(-1)
    v1, v2 = draft_masks(ids, lens, 1)
    ok1 = d1 == ids[:, 2:]
    ok2 = ok1[:, :-1] & (d2 == ids[:, 3:])
    return {"position_1": round(float(ok1[v1].float().mean()), 4),
            "position_2": round(float(ok2[v2].float().mean()), 4),
            "drafts_1": int(v1.sum()), "drafts_2": int(v2.sum())}


def train_head(head, embed, lm_head, ids, lens, hidden):
    """Cross-entropy of draft 1 and (weighted) the chained draft 2 to the target's greedy tokens; Adam, full
    batch, the target frozen; stops at the first multiple of 10 steps with position-1 acceptance >= stop_at."""
    v1, v2 = draft_masks(ids, lens, 2)
    opt = torch.optim.Adam(list(head.parameters()), lr=TRAIN["lr"])
    ce = torch.nn.functional.cross_entropy
    loss = torch.tensor(0.0)
    for step in range(TRAIN["max_steps"]):
        if step % 10 == 0 and acceptance(head.eval(), embed, lm_head, ids, lens, hidden)["position_1"] >= TRAIN["stop_at"]:
            break
        head.train()
        m1, m2 = head.chained(embed, ids, hidden)
        loss = (ce(lm_head(m1[:, :-1])[v1], ids[:, 2:][v1])
                + TRAIN["chain_weight"] * ce(lm_head(m2[:, :-1])[v2], ids[:, 3:][v2]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    return step, float(loss.detach())


def main():
    t0 = time.time()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    src, out = os.path.join(FIX, SRC), os.path.join(FIX, NAME)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "preprocessor_config.json"):
        shutil.copyfile(os.path.join(src, f), os.path.join(out, f))
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["text_config"]["num_nextn_predict_layers"] = 1
    write_json(os.path.join(out, "config.json"), cfg)
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    shutil.copyfile(os.path.join(src, "model.safetensors"), os.path.join(out, shard1))  # byte-identical

    # ---- the target (the source checkpoint: transformers would drop the NextN layer anyway)
    model = transformers.Glm4vMoeForConditionalGeneration.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager").eval()
    tm, lm_head = model.model.language_model, model.lm_head
    tcfg = tm.config
    for p in model.parameters():
        p.requires_grad_(False)
    embed = tm.embed_tokens.weight
    src_ref = load_file(os.path.join(src, "reference.safetensors"))
    prompt = src_ref["text.input_ids"].to(torch.int64)

    # ---- self-check: the wiring around a decoder layer, given the target's layer 2 (MoE) weights,
    # reproduces the target's layer 2 output
    seen = {}
    hnd = tm.layers[2].register_forward_hook(
        lambda m, a, kw, o: seen.update(inp=a[0].detach().clone(), out=o.detach().clone()), with_kwargs=True)
    with torch.no_grad():
        tm(input_ids=prompt[None])
    hnd.remove()
    chk = NextN(tcfg)
    chk.layer.load_state_dict(tm.layers[2].state_dict())
    with torch.no_grad():
        d_layer2 = float((chk.decoder(seen["inp"], torch.arange(prompt.shape[0])) - seen["out"]).abs().max())
    assert d_layer2 < 1e-5, d_layer2

    # ---- training on the target's greedy continuations
    head = random_nextn(tcfg, SEED)
    train = greedy_batch(tm, lm_head, [prompt] + random_prompts(TRAIN["prompts"], SEED + TRAIN["prompt_seed"]))
    held = greedy_batch(tm, lm_head, random_prompts(TRAIN["heldout_prompts"], SEED + TRAIN["heldout_seed"]))
    accept = {"random_init_train": acceptance(head.eval(), embed, lm_head, *train)}
    steps, final_loss = train_head(head, embed, lm_head, *train)
    tensors = head.export()
    save_file(tensors, os.path.join(out, shard2), metadata={"format": "pt"})
    main_keys = load_file(os.path.join(out, shard1))
    total = sum(v.numel() * v.element_size() for v in [*main_keys.values(), *tensors.values()])
    wm = {**{k: shard1 for k in main_keys}, **{k: shard2 for k in tensors}}
    write_json(os.path.join(out, "model.safetensors.index.json"),
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))})

    # ---- the reference, from the layer as saved (bf16 weights in f32)
    saved = NextN(tcfg).load(load_file(os.path.join(out, shard2))).eval()
    accept["train"] = acceptance(saved, embed, lm_head, *train)
    accept["heldout"] = acceptance(saved, embed, lm_head, *held)
    print(f"{NAME}: steps {steps} loss {final_loss:.4f} acceptance {accept} ({time.time() - t0:.1f} s)", flush=True)
    ids, lens, hidden_batched = train
    n = int(lens[0]) + N_NEW
    tokens = ids[0, :n].clone()
    with torch.no_grad():
        hidden = tm(input_ids=tokens[None]).last_hidden_state[0]
        d_batched = float((hidden - hidden_batched[0, :n]).abs().max())
        assert d_batched < 1e-4, d_batched
        tail = lm_head(hidden[:prompt.shape[0]])[-src_ref["text.logits_tail"].shape[0]:]
        d_src = rel(tail, src_ref["text.logits_tail"])
        assert d_src < 1e-4, d_src
        emb = embed[tokens[1:]][None]
        m = saved(emb, hidden[None, :-1], torch.arange(n - 1))[0]
        logits = lm_head(m)
        d_step = float((saved.stepped(emb, hidden[None, :-1])[0] - m).abs().max())
        # transformers' own MtpLayer (enorm, hnorm, eh_proj, mtp_block, post_norm) with the same weights
        ref_layer = transformers.modeling_layers.MtpLayer(tcfg, glm.Glm4vMoeTextDecoderLayer,
                                                          glm.Glm4vMoeTextRMSNorm, tcfg.num_hidden_layers)
        sd = {k.replace("layer.", "mtp_block.", 1).replace("shared_head_norm", "post_norm"): v
              for k, v in saved.state_dict().items()}
        ref_layer.load_state_dict(sd, strict=True)
        ref_layer.eval()
        t = n - 1
        mask = torch.zeros(t, t).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                             torch.finfo(torch.float32).min)[None, None]
        pos = torch.arange(t)
        m_hf = ref_layer(emb, hidden[None, :-1], saved.rotary(emb, pos.view(1, 1, -1).expand(3, 1, -1)), mask,
                         pos[None], None)[0]
        d_hf = float((m_hf - m).abs().max())
    assert d_hf < 1e-5 and d_step < 1e-4, (d_hf, d_step)
    checks = {"self_check_layer2_weights_vs_target_layer2_output_max_abs_diff": d_layer2,
              "transformers_MtpLayer_vs_reference_mtp_hidden_max_abs_diff": d_hf,
              "stepped_with_dynamic_cache_vs_causal_pass_mtp_hidden_max_abs_diff": d_step,
              "target_logits_vs_source_reference_max_rel_diff": d_src,
              "hidden_alone_vs_batched_greedy_pass_max_abs_diff": d_batched}
    ref = {"tokens": tokens.contiguous(), "hidden": hidden.contiguous(), "mtp_hidden": m.contiguous(),
           "mtp_logits": logits.contiguous()}
    save_file(ref, os.path.join(out, "reference_mtp.safetensors"),
              metadata={"generator": f"scripts/make_glm_nextn_fixture.py transformers={transformers.__version__}"})
    top2 = logits.topk(2, -1).values
    info = {"source": f"tests/fixtures/{SRC}", "seed": SEED, "nextn_layer": f"{LM}layers.{tcfg.num_hidden_layers}",
            "n_nextn_tensors": len(tensors), "checks": checks, "acceptance": accept,
            "training": {"steps": steps, "final_loss": round(final_loss, 4), **TRAIN, "prompt_len": list(PROMPT_LEN),
                         "continuation": N_NEW,
                         "train_sequences": [{"prompt": " ".join(map(str, s[:k].tolist())),
                                              "continuation": " ".join(map(str, s[k:k + N_NEW].tolist()))}
                                             for s, k in zip(train[0], train[1].tolist())]},
            "keys": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(ref.items())},
            "greedy_draft_tokens": logits.argmax(-1).tolist(),
            "min_top1_top2_margin": float((top2[:, 0] - top2[:, 1]).min()),
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__}}
    write_json(os.path.join(out, "reference_mtp.json"), info, indent=1)
    for f in os.listdir(out):
        os.chmod(os.path.join(out, f), 0o644)
    print(f"{NAME}: N={n} checks={checks} ({time.time() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
