#!/usr/bin/env python3
"""Tiny random Gemma 4 assistant drafters paired with the Gemma 4 fixtures (transformers 5.24).

    tests/fixtures/tiny-gemma4-assistant/       Gemma4AssistantForCausalLM (`gemma4_assistant`) for
                                                tiny-gemma4: hidden 32, a sliding and a full layer,
                                                both KV-shared (they read the target's layer 1 and
                                                layer 2 K/V), the target's head widths and rotary;
                                                ordered embeddings (16 centroids of 64 tokens, top 4)
                                                so the centroid-masked head is exercised.
    tests/fixtures/tiny-gemma4-moe-assistant/   the same for tiny-gemma4-moe (2 sliding KV heads;
                                                K-eq-V full layers of 1 KV head: it reads the
                                                target's layers 4 and 5), a plain tied head.

reference.safetensors, per case (prompts shorter and longer than the sliding window of 8):
    {case}.prompt          the prompt ids (the target processed them; its cache holds their K/V)
    {case}.draft_tokens    [K] the assistant's greedy drafts after the target's first sampled token
    {case}.draft_logits    [K, vocab] the assistant's logits at each draft step
computed as transformers' SinglePositionMultiTokenCandidateGenerator drafts after the prefill: input
= concat(target embedding of the last token (scaled), the target's final-norm hidden row of the
position before it), position = index of the last token, keys = every cached position, the
sliding layer the last window+1 of them. reference.json also holds transformers' greedy generate
with assistant_model= next to plain greedy (the script asserts they are equal).

    /work/venv-torch/bin/python scripts/make_gemma4_assistant_fixture.py   # a few seconds, offline
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

from make_gemma4_fixtures import FULL, SLIDING, TEXT, perturb_  # noqa: E402

OUT = os.path.join(mf.REPO, "tests", "fixtures")
K = 4
SEED = 4242
ASSISTANT_TEXT = dict(
    vocab_size=mf.MODEL_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, max_position_embeddings=4096,
    initializer_range=0.2, sliding_window=TEXT["sliding_window"], layer_types=[SLIDING, FULL],
    num_kv_shared_layers=2, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
    tie_word_embeddings=True, rope_parameters=TEXT["rope_parameters"],
)
# (target, its class, assistant, seed, text_config overrides, assistant config overrides)
PAIRS = [
    ("tiny-gemma4", "Gemma4ForConditionalGeneration", "tiny-gemma4-assistant", SEED, {},
     dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4)),
    ("tiny-gemma4-moe", "Gemma4ForCausalLM", "tiny-gemma4-moe-assistant", SEED + 10,
     dict(num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1), {}),
]
PROMPTS = {
    "short": [2, 17, 305, 41, 88],
    "long": [2, 9, 400, 33, 12, 700, 5, 61, 230, 18, 99, 512, 7, 300, 44, 21, 800, 3, 150, 66],
}


def draft(target, assistant, ids, k):
    """The candidate generator's first round, by hand: returns (tokens [k], logits [k, V])."""
    with torch.no_grad():
        out = target(input_ids=ids[None], use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
        first = out.logits[0, -1].argmax()
        embed = target.get_input_embeddings()
        hidden = out.hidden_states[-1][:, -1:]
        kv = out.shared_kv_states
        kv = {t: (kv[t][0], kv[t][1]) for t in (SLIDING, FULL)}
        last = first.view(1, 1)
        pos = torch.tensor([[len(ids)]])
        mask = torch.ones(1, len(ids) + 1, dtype=torch.long)
        tokens, logits = [], []
        for _ in range(k):
            x = torch.cat([embed(last), hidden], dim=-1)
            o = assistant(inputs_embeds=x, attention_mask=mask, position_ids=pos, shared_kv_states=kv)
            last = o.logits.argmax(dim=-1)
            hidden = o.last_hidden_state
            tokens.append(int(last))
            logits.append(o.logits[0, 0])
    return int(first), torch.tensor(tokens), torch.stack(logits)


def make(target_name, target_cls, name, seed, text_over, cfg_over):
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    cls = getattr(transformers, target_cls)
    target = cls.from_pretrained(os.path.join(OUT, target_name), dtype=torch.float32,
                                 attn_implementation="eager").eval()
    tcfg = target.config.get_text_config()
    special = dict(bos_token_id=tcfg.bos_token_id, eos_token_id=tcfg.eos_token_id, pad_token_id=tcfg.pad_token_id)
    torch.manual_seed(seed)
    cfg = Gemma4AssistantConfig(text_config=ASSISTANT_TEXT | text_over | special,
                                backbone_hidden_size=tcfg.hidden_size, **cfg_over, **special)
    model = Gemma4AssistantForCausalLM._from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    perturb_(model, torch.Generator().manual_seed(seed + 1))
    if cfg.use_ordered_embeddings:
        with torch.no_grad():
            order = torch.randperm(cfg.text_config.vocab_size, generator=torch.Generator().manual_seed(seed + 2))
            model.masked_embedding.token_ordering.copy_(order)
    model.eval()
    model.generation_config.num_assistant_tokens = K  # the candidate generator reads it from here
    out_dir = os.path.join(OUT, name)
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        os.remove(os.path.join(out_dir, f))
    model.save_pretrained(out_dir)
    for f in os.listdir(out_dir):  # save_pretrained writes the weights 0600
        os.chmod(os.path.join(out_dir, f), 0o644)
    assistant = Gemma4AssistantForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()

    tensors, cases = {}, {}
    for case, prompt in PROMPTS.items():
        ids = torch.tensor(prompt, dtype=torch.int64)
        first, tokens, logits = draft(target, assistant, ids, K)
        tensors[f"{case}.prompt"] = ids
        tensors[f"{case}.draft_tokens"] = tokens
        tensors[f"{case}.draft_logits"] = logits.contiguous()
        with torch.no_grad():
            plain = target.generate(ids[None], max_new_tokens=12, do_sample=False)[0, len(prompt):]
            assisted = target.generate(ids[None], max_new_tokens=12, do_sample=False, assistant_model=assistant)[0, len(prompt):]
        assert plain.tolist() == assisted.tolist(), (case, plain.tolist(), assisted.tolist())
        cases[case] = {"prompt": prompt, "first_token": first, "draft_tokens": tokens.tolist(),
                       "greedy": plain.tolist(), "assisted_greedy": assisted.tolist()}
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"),
              metadata={"generator": f"scripts/make_gemma4_assistant_fixture.py transformers={transformers.__version__}"})
    info = {"target": target_name, "num_draft_steps": K, "cases": cases,
            "transformers_version": transformers.__version__, "torch_version": torch.__version__, "seed": seed}
    with open(os.path.join(out_dir, "reference.json"), "w") as fh:
        json.dump(info, fh, indent=1)
        fh.write("\n")


def main():
    for pair in PAIRS:
        make(*pair)


if __name__ == "__main__":
    main()
