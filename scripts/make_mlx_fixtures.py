#!/usr/bin/env python3
"""Make the MLX-format test fixtures under tests/fixtures/mlx/ and their mlx reference outputs.

Run (offline, CPU, ~10 s on 2 cores):

    python3 -m venv /work/venv-mlx
    /work/venv-mlx/bin/pip install "mlx[cpu]" mlx-lm mlx-vlm
    /work/venv-mlx/bin/python scripts/make_mlx_fixtures.py

Versions used for the committed files: mlx 0.32.4 (mlx-cpu 0.32.4), mlx-lm 0.32.2,
mlx-vlm 0.7.10, transformers 5.24.0, tokenizers 0.23.3, safetensors 0.8.0, numpy 2.4.6
(Python 3.11, Linux x86-64, CPU). No torch is needed.

What it writes (see tests/fixtures/mlx/README.md for the per-fixture facts):

1. `quant_vectors.safetensors`: `mx.quantize` / `mx.dequantize` test vectors for every
   bits in {2,3,4,5,6,8} x group in {32,64,128} (affine mode).
2. `<name>/`: conversions of the tiny HF fixtures (tests/fixtures/tiny-*) made by mlx-lm's
   `convert()` (text models) or mlx-vlm's `convert()` (VLMs and Qwen3.5), with config.json,
   model.safetensors (+ the index the converter writes), tokenizer and processor files.
   Some sources are first copied to a staging directory and adapted where the converter
   refuses the transformers-5 layout (recorded in `ADAPTATIONS` below and in the README).
3. `<name>/reference.safetensors`: mlx's own forward pass on the converted directory
   (`mlx_lm.load` / `mlx_vlm.load`, CPU): `input_ids` (int64 [T], the source fixture's
   `text.input_ids`), `logits` (f32 [T, V], full sequence, no cache) and `generated_ids`
   (int64 [10], greedy argmax re-running the full forward, not stopping at EOS). VLMs add an
   `image.*` case built from the source fixture's `single` case.
   `<name>/reference.json` records the recipe, which modules were quantized (bits/group),
   scale dtype, norm shift, conv layouts, margins and a float (unquantized) mlx-vs-HF check.
4. `README.md`: the general layout facts and a section per fixture (generated).
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

import mlx.core as mx
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
OUT = FIX / "mlx"
N_GEN = 10

mx.set_default_device(mx.cpu)


# --------------------------------------------------------------------------------------------
# 1. quantization test vectors
# --------------------------------------------------------------------------------------------

def make_quant_vectors():
    rng = np.random.default_rng(1234)
    t = {}
    meta = {}
    for bits in (2, 3, 4, 5, 6, 8):
        for group in (32, 64, 128):
            # [3, 3*group]: an odd number of groups per row, so 3/5/6-bit codes cross u32 words
            # at group boundaries too; plus one [5, group] case (one group per row).
            for tag, shape in (("", (3, 3 * group)), (".r5", (5, group))):
                w = rng.normal(0.0, 1.0, size=shape).astype(np.float32)
                # a few rows with special structure: all-positive, all-negative, one exact zero
                w[0] = np.abs(w[0]) + 0.25
                w[1] = -np.abs(w[1]) - 0.25
                w[2, 5] = 0.0
                wq, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits)
                dq = mx.dequantize(wq, s, b, group_size=group, bits=bits)
                p = f"b{bits}_g{group}{tag}"
                t[p + ".w"] = w
                t[p + ".w_q"] = np.array(wq)
                t[p + ".scales"] = np.array(s)
                t[p + ".biases"] = np.array(b)
                t[p + ".dequant"] = np.array(dq.astype(mx.float32))
                assert t[p + ".w_q"].dtype == np.uint32
                assert t[p + ".w_q"].shape == (shape[0], shape[1] * bits // 32)
                meta[p] = {"bits": bits, "group_size": group, "shape": list(shape),
                           "max_abs_err": float(np.abs(t[p + ".dequant"] - w).max())}
    # bf16 case: scales/biases bf16, dequant computed by mlx in bf16, stored as f32
    w = rng.normal(0.0, 1.0, size=(3, 192)).astype(np.float32)
    wb = mx.array(w).astype(mx.bfloat16)
    wq, s, b = mx.quantize(wb, group_size=64, bits=4)
    assert s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16
    dq = mx.dequantize(wq, s, b, group_size=64, bits=4)
    assert dq.dtype == mx.bfloat16
    p = "b4_g64_bf16"
    t[p + ".w"] = np.array(wb.astype(mx.float32))  # the bf16 input, widened
    t[p + ".w_q"] = np.array(wq)
    # safetensors.numpy has no bf16: store the bf16 values widened to f32 (exact)
    t[p + ".scales"] = np.array(s.astype(mx.float32))
    t[p + ".biases"] = np.array(b.astype(mx.float32))
    t[p + ".dequant"] = np.array(dq.astype(mx.float32))
    meta[p] = {"bits": 4, "group_size": 64, "shape": [3, 192], "dtype": "bfloat16",
               "note": "scales/biases are bf16 values stored widened to f32; dequant computed "
                       "by mlx in bf16 (scale*q+bias rounded to bf16), then widened"}
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(t, str(OUT / "quant_vectors.safetensors"),
              metadata={"mlx": mx.__version__, "mode": "affine"})
    return meta


# --------------------------------------------------------------------------------------------
# 2. staging: copies of the source fixtures the converters accept
# --------------------------------------------------------------------------------------------

def stage(src: Path, dst: Path) -> Path:
    """Copy the model files only (the converters glob *.safetensors, which would pick up
    reference.safetensors)."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name.startswith("reference") or f.suffix == ".png":
            continue
        shutil.copy(f, dst / f.name)
    return dst


def _rw_config(d: Path, fn):
    c = json.loads((d / "config.json").read_text())
    c = fn(c) or c
    (d / "config.json").write_text(json.dumps(c, indent=2))


def _rw_weights(d: Path, fn):
    files = sorted(d.glob("model*.safetensors"))
    assert len(files) == 1, files
    w = mx.load(str(files[0]))  # bf16 sources: numpy has no bf16
    w = fn(w)
    files[0].unlink()
    mx.save_safetensors(str(d / "model.safetensors"), w, metadata={"format": "pt"})
    idx = d / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()


def adapt_qwen2_vl(d: Path):
    # mlx-vlm's qwen2_vl reads the flat hub config (text fields at top level, rope_theta and
    # rope_scaling{type: mrope, mrope_section}); tiny-qwen2-vl has the transformers-5 nested
    # text_config/rope_parameters form. Its VisionModel also insists on model_type "qwen2_vl".
    def f(c):
        tc = c.pop("text_config")
        rp = tc.pop("rope_parameters")
        for k, v in tc.items():
            if k not in ("model_type", "dtype"):
                c.setdefault(k, v)
        c["rope_theta"] = rp["rope_theta"]
        c["rope_scaling"] = {"type": "mrope", "mrope_section": rp["mrope_section"]}
        c["vision_config"]["model_type"] = "qwen2_vl"
        c["vision_config"].pop("rope_parameters", None)
    _rw_config(d, f)
    return ["config flattened to the hub form (text_config fields to top level, rope_parameters "
            "-> rope_theta + rope_scaling{type: mrope}), vision_config.model_type -> qwen2_vl"]


def adapt_qwen25_vl(d: Path):
    # flat config already; vision model_type must be "qwen2_5_vl"; mlx-vlm's sanitize maps the
    # hub weight names (model.layers.*, visual.*, lm_head) only, not transformers-5's
    # model.language_model.* / model.visual.*
    def f(c):
        c["vision_config"]["model_type"] = "qwen2_5_vl"
        c["vision_config"].pop("rope_parameters", None)
    _rw_config(d, f)

    def g(w):
        out = {}
        for k, v in w.items():
            if k.startswith("model.language_model."):
                k = "model." + k[len("model.language_model."):]
            elif k.startswith("model.visual."):
                k = "visual." + k[len("model.visual."):]
            out[k] = v
        return out
    _rw_weights(d, g)
    return ["vision_config.model_type -> qwen2_5_vl",
            "weights renamed to the hub layout (model.language_model.* -> model.*, "
            "model.visual.* -> visual.*) because mlx-vlm's sanitize only maps that layout"]


def adapt_glm4v(d: Path):
    # mlx-vlm's glm4v vision attention has no qkv bias (real GLM-4.1V has attention_bias
    # false); tiny-glm4v has one. Drop it (the text path does not use the vision tower).
    def g(w):
        return {k: v for k, v in w.items() if not k.endswith("attn.qkv.bias")}
    _rw_weights(d, g)

    def f(c):
        c["vision_config"]["attention_bias"] = False
    _rw_config(d, f)
    return ["vision blocks' attn.qkv.bias dropped and vision_config.attention_bias -> false "
            "(mlx-vlm's glm4v vision attention has no qkv bias); text path unaffected"]


def adapt_glm4v_moe(d: Path):
    # mlx-vlm's glm4v_moe TextConfig requires use_qk_norm (hub GLM-4.5V configs have it, false)
    def f(c):
        c["text_config"]["use_qk_norm"] = False
    _rw_config(d, f)
    return ["text_config.use_qk_norm: false added (required by mlx-vlm's glm4v_moe TextConfig; "
            "the hub GLM-4.5V config has it)"]


def adapt_gemma4(d: Path):
    # transformers 5.24 saves the full layers' geometry as `per_layer_config`; the hub configs,
    # mlx-lm and mlx-vlm read `global_head_dim` / `num_global_key_value_heads` (mlx's default
    # global_head_dim is 512), from which transformers rebuilds the same per_layer_config.
    def f(c):
        tc = c.get("text_config", c)
        plc = tc.pop("per_layer_config")
        full = [i for i, t in enumerate(tc["layer_types"]) if t == "full_attention"]
        assert sorted(int(k) for k in plc) == full and len({json.dumps(v) for v in plc.values()}) == 1, plc
        o = plc[str(full[0])]
        tc["global_head_dim"] = o["head_dim"]
        if "num_key_value_heads" in o:
            tc["num_global_key_value_heads"] = o["num_key_value_heads"]
    _rw_config(d, f)
    return ["`per_layer_config` replaced by the hub form `global_head_dim` (+ "
            "`num_global_key_value_heads` with K-eq-V), which mlx-lm / mlx-vlm read (mlx's default "
            "global_head_dim is 512) and from which transformers rebuilds the same per_layer_config"]


def adapt_gemma4_vlm(d: Path):
    """The hub config form, then two changes so that the conversion holds what real E2B/E4B
    conversions hold: a quantized per-layer-embedding table (its width L*P = 6*8 = 48 is no
    multiple of any MLX group, so P is doubled to 16: 96 = 3 groups of 32; the original columns
    are kept, the new ones are seeded normal noise of the same spread) and a vision tower with
    clippable linears (use_clipped_linears, 0-d clip bounds beside every projection, seeded,
    tight enough to bind). So this staged model is not the source's: its float check runs on a
    staging with only the config change."""
    notes = adapt_gemma4(d)
    rng = np.random.default_rng(4242)
    c = json.loads((d / "config.json").read_text())
    tc = c["text_config"]
    L, P = tc["num_hidden_layers"], tc["hidden_size_per_layer_input"]

    def noise(shape, like):
        return rng.normal(float(like.mean()), float(like.std()), size=shape).astype(np.float32)

    def g(w):
        w = {k: np.array(v) for k, v in w.items()}
        pre = "model.language_model."
        e = w[pre + "embed_tokens_per_layer.weight"]  # [V, L*P], layer-major
        v = e.shape[0]
        e3 = e.reshape(v, L, P)
        w[pre + "embed_tokens_per_layer.weight"] = np.concatenate(
            [e3, noise(e3.shape, e3)], axis=2).reshape(v, L * 2 * P)
        m = w[pre + "per_layer_model_projection.weight"]  # [L*P, H]
        m3 = m.reshape(L, P, -1)
        w[pre + "per_layer_model_projection.weight"] = np.concatenate(
            [m3, noise(m3.shape, m3)], axis=1).reshape(L * 2 * P, -1)
        n = w[pre + "per_layer_projection_norm.weight"]
        w[pre + "per_layer_projection_norm.weight"] = np.concatenate([n, noise(n.shape, n)])
        for i in range(L):
            gate = w[f"{pre}layers.{i}.per_layer_input_gate.weight"]  # [P, H]
            w[f"{pre}layers.{i}.per_layer_input_gate.weight"] = np.concatenate(
                [gate, noise(gate.shape, gate)], axis=0)
            proj = w[f"{pre}layers.{i}.per_layer_projection.weight"]  # [H, P]
            w[f"{pre}layers.{i}.per_layer_projection.weight"] = np.concatenate(
                [proj, noise(proj.shape, proj)], axis=1)
        for k in sorted(w):
            if k.startswith("model.vision_tower.encoder.") and k.endswith(".linear.weight"):
                p = k[: -len(".linear.weight")]
                for side in ("input", "output"):
                    lo, hi = rng.uniform(0.6, 1.6, size=2)
                    w[f"{p}.{side}_min"] = np.array(-lo, dtype=np.float32)
                    w[f"{p}.{side}_max"] = np.array(hi, dtype=np.float32)
        return {k: mx.array(v) for k, v in w.items()}
    _rw_weights(d, g)

    def f(c):
        c["text_config"]["hidden_size_per_layer_input"] = 2 * P
        c["vision_config"]["use_clipped_linears"] = True
    _rw_config(d, f)
    return notes + [f"per-layer-embedding width doubled ({P} -> {2 * P}: the table's {L}x{P} = {L * P} "
                    f"columns fit no MLX group, {L * 2 * P} fit groups of 32) with seeded columns "
                    "beside the original ones", "vision_config.use_clipped_linears -> true with "
                    "seeded 0-d clip bounds (input/output min in [-1.6, -0.6], max in [0.6, 1.6]) "
                    "beside every vision projection", "float check on a staging with the config "
                    "change only (this staged model is not the source's)"]


def adapt_gemma4_lm(d: Path):
    notes = adapt_gemma4(d)

    def f(c):
        c["vocab_size"] = c["text_config"]["vocab_size"]
    _rw_config(d, f)
    return notes + ["top-level `vocab_size` added (mlx-lm's gemma4 ModelArgs reads it there, "
                    "default 262144, and passes it to the text model)"]


ADAPT = {
    "tiny-qwen2-vl": adapt_qwen2_vl,
    "tiny-qwen2.5-vl": adapt_qwen25_vl,
    "tiny-glm4v": adapt_glm4v,
    "tiny-glm4v-moe": adapt_glm4v_moe,
    "tiny-gemma4": adapt_gemma4,
    "tiny-gemma4-moe": adapt_gemma4,
}


# --------------------------------------------------------------------------------------------
# 3. recipes
# --------------------------------------------------------------------------------------------

def llama_mixed_predicate(path, module):
    """Custom recipe: a dict for some modules, False for one, True (global 4-bit g64) for the
    rest."""
    if path == "model.layers.1.self_attn.k_proj":
        return False  # this Linear stays float in a quantized model
    if path.endswith("self_attn.v_proj"):
        return {"group_size": 32, "bits": 6, "mode": "affine"}
    if path.endswith("mlp.down_proj"):
        return {"group_size": 128, "bits": 8, "mode": "affine"}
    if path == "model.embed_tokens":  # tied: also the output head
        return {"group_size": 32, "bits": 5, "mode": "affine"}
    if path == "model.layers.0.mlp.gate_proj":
        return {"group_size": 64, "bits": 3, "mode": "affine"}
    return True


def qwen35_moe_predicate(path, module):
    """mlx-vlm's qwen3_5 predicate for MoE (mlp.gate and shared_expert_gate at 8 bits) with the
    group lowered to 32, because the tiny model's hidden size is 32 (with group 64 those
    layers would be skipped), and mlx-vlm's multimodal skip."""
    from mlx_vlm.utils import skip_multimodal_module
    if skip_multimodal_module(path):
        return False
    if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
        return {"group_size": 32, "bits": 8}
    return True


def gemma4_moe_predicate(path, module):
    """mlx-lm's gemma4_text predicate (the router's `proj` at 8 bits, group 64) plus per-layer
    overrides on stacked experts, as mixed recipes write them (keys
    `model.layers.N.experts.switch_glu.{gate,up}_proj`)."""
    if path.endswith("router.proj"):
        return {"group_size": 64, "bits": 8}
    if path in ("model.layers.0.experts.switch_glu.up_proj", "model.layers.3.experts.switch_glu.up_proj"):
        return {"group_size": 32, "bits": 8}
    if path == "model.layers.1.experts.switch_glu.gate_proj":
        return {"group_size": 64, "bits": 6}
    return True


SPECS = [
    # name, source, converter, bits, group, dtype, extra
    dict(name="llama-4bit-g32", src="tiny-llama", conv="lm", bits=4, group=32),
    dict(name="llama-4bit-g64-bf16", src="tiny-llama", conv="lm", bits=4, group=64,
         dtype="bfloat16"),
    dict(name="llama-8bit-g64", src="tiny-llama", conv="lm", bits=8, group=64),
    dict(name="llama-3bit-g32", src="tiny-llama", conv="lm", bits=3, group=32),
    dict(name="llama-6bit-g64", src="tiny-llama", conv="lm", bits=6, group=64),
    dict(name="llama-2bit-g32", src="tiny-llama", conv="lm", bits=2, group=32),
    dict(name="llama-5bit-g32", src="tiny-llama", conv="lm", bits=5, group=32),
    dict(name="llama-mixed", src="tiny-llama", conv="lm", bits=4, group=64,
         predicate=llama_mixed_predicate, recipe="custom predicate (llama_mixed_predicate)"),
    dict(name="llama-mixed_3_6", src="tiny-llama", conv="lm", bits=3, group=64,
         predicate="mixed_3_6", recipe="mlx-lm recipe mixed_3_6"),
    dict(name="qwen2-4bit-g64", src="tiny-qwen2", conv="lm", bits=4, group=64),
    dict(name="qwen3-4bit-g64", src="tiny-qwen3", conv="lm", bits=4, group=64),
    dict(name="gemma3-4bit-g64", src="tiny-gemma3", conv="lm", bits=4, group=64),
    dict(name="qwen2-vl-4bit", src="tiny-qwen2-vl", conv="vlm", bits=4, group=64),
    dict(name="qwen2.5-vl-4bit", src="tiny-qwen2.5-vl", conv="vlm", bits=4, group=64),
    # GLM: mlx-vlm's vision path does not reproduce transformers' on these fixtures (see README),
    # so no image case; the vision tower is kept bf16 to save space
    dict(name="glm4v-4bit", src="tiny-glm4v", conv="vlm", bits=4, group=64,
         vision_source_dtype=True, image_case=False),
    dict(name="glm4v-moe-4bit", src="tiny-glm4v-moe", conv="vlm", bits=4, group=32,
         vision_source_dtype=True, image_case=False),
    dict(name="qwen3.5-4bit", src="tiny-qwen3.5", conv="vlm", bits=4, group=64),
    dict(name="qwen3.5-moe-4bit", src="tiny-qwen3.5-moe", conv="vlm", bits=4, group=32,
         predicate=qwen35_moe_predicate,
         recipe="mlx-vlm qwen3_5 MoE predicate with group 32 (gate/shared_expert_gate 8-bit)"),
    # Gemma 4 (see adapt_gemma4*): `stepped` adds mlx's token-by-token logits (its KV cache,
    # rotating for the sliding layers, shared for the KV-sharing ones); the VLM's image case
    # goes through mlx-vlm's own processor.
    dict(name="gemma4-4bit", src="tiny-gemma4", conv="vlm", bits=4, group=32,
         adapt=adapt_gemma4_vlm, float_adapt=adapt_gemma4, stepped=True, image_case="gemma4"),
    dict(name="gemma4-text-4bit", src="tiny-gemma4", conv="lm", bits=4, group=64,
         adapt=adapt_gemma4_lm, stepped=True),
    dict(name="gemma4-moe-4bit", src="tiny-gemma4-moe", conv="lm", bits=4, group=32,
         predicate=gemma4_moe_predicate, stepped=True,
         recipe="mlx-lm gemma4_text predicate (router.proj 8/64) + expert overrides "
                "(gemma4_moe_predicate)"),
]


# --------------------------------------------------------------------------------------------
# 4. conversion + reference
# --------------------------------------------------------------------------------------------

class naive_detokenizer:
    """mlx-lm builds an SPM streaming detokenizer from every id below len(tokenizer), which fails
    on tiny-gemma4's tokenizer (952 tokens with ids up to 1023, the multimodal ones at the top);
    the plain one (only used for streaming text, never for the weights) takes any ids."""

    def __enter__(self):
        import mlx_lm.tokenizer_utils as tu
        self.saved = tu.SPMStreamingDetokenizer
        tu.SPMStreamingDetokenizer = lambda tok, trim_space=True: tu.NaiveStreamingDetokenizer(tok)

    def __exit__(self, *exc):
        import mlx_lm.tokenizer_utils as tu
        tu.SPMStreamingDetokenizer = self.saved


def convert(spec, staged: Path, dst: Path):
    kw = dict(quantize=True, q_group_size=spec["group"], q_bits=spec["bits"],
              dtype=spec.get("dtype", "float32"))
    if spec.get("predicate") is not None:
        kw["quant_predicate"] = spec["predicate"]
    if spec["conv"] == "lm":
        from mlx_lm import convert as lm_convert
        with naive_detokenizer():
            lm_convert(str(staged), str(dst), **kw)
    else:
        from mlx_vlm.convert import convert as vlm_convert
        from mlx_vlm.utils import get_model_and_args, load_config
        cls, _ = get_model_and_args(load_config(staged))
        saved = cls.Model.__dict__.get("cast_predicate")
        if spec.get("vision_source_dtype"):
            # keep the (unquantized) vision tower in the source dtype (bf16), cast the rest:
            # convert() only consults the model's cast_predicate (used for A_log normally)
            inner = getattr(cls.Model, "cast_predicate", None)

            def cp(self):
                base = inner.fget(self) if isinstance(inner, property) else (lambda _: True)
                return lambda k: not k.startswith("vision_tower") and base(k)
            cls.Model.cast_predicate = property(cp)
        try:
            vlm_convert(str(staged), str(dst), **kw)
        finally:
            if spec.get("vision_source_dtype"):
                if saved is None:
                    del cls.Model.cast_predicate
                else:
                    cls.Model.cast_predicate = saved
    # the model card the converters write is not needed
    (dst / "README.md").unlink(missing_ok=True)
    # mlx-vlm writes processor_config.json from its own processor defaults when the source has no
    # image processor config (tiny-qwen3.5-moe: patch 16 against the tower's 14, which iris
    # rejects as a checkpoint whose parts disagree); without it the source's defaults hold
    if not (staged / "preprocessor_config.json").exists() and not (staged / "processor_config.json").exists():
        (dst / "processor_config.json").unlink(missing_ok=True)
    # tokenizer files the converter did not write: copy from the source
    for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"):
        if not (dst / n).exists() and (staged / n).exists():
            shutil.copy(staged / n, dst / n)


def load_mlx(spec, path: Path):
    if spec["conv"] == "lm":
        from mlx_lm import load
        with naive_detokenizer():
            model, _ = load(str(path))

        def fwd(ids, **kw):
            return model(mx.array(ids)[None])[0]
        return model, fwd
    # load_model, not load: load also builds the streaming detokenizer, which needs a
    # tokenizer without holes in its ids (tiny-gemma4's has 952 tokens up to id 1023)
    from mlx_vlm.utils import load_model
    model = load_model(Path(path))
    lm = model.language_model

    def reset():
        for a in ("_position_ids", "_rope_deltas"):
            if hasattr(lm, a):
                setattr(lm, a, None)

    def fwd(ids, **kw):
        reset()
        if kw:
            out = model(mx.array(ids)[None], **kw)
        else:
            out = lm(mx.array(ids)[None])
        reset()
        return out.logits[0]
    return model, fwd


def greedy(fwd, ids, **kw):
    ids = list(int(i) for i in ids)
    gen, margins = [], []
    for _ in range(N_GEN):
        lg = np.array(fwd(ids, **kw)[-1].astype(mx.float32))
        t1 = int(np.argmax(lg))  # first index among ties, like mx.argmax / torch.argmax
        margins.append(float(lg[t1] - np.max(np.delete(lg, t1))))
        gen.append(t1)
        ids.append(t1)
    return np.array(gen, dtype=np.int64), margins


def stepped_logits(spec, model, ids):
    """mlx's logits of `ids` fed one token at a time through its own KV cache."""
    if spec["conv"] == "lm":
        from mlx_lm.models.cache import make_prompt_cache
        cache = make_prompt_cache(model)

        def step(x):
            return model(x, cache=cache)
    else:
        lm = model.language_model
        cache = lm.make_cache()

        def step(x):
            return lm(x, cache=cache).logits
    rows = [np.array(step(mx.array([[int(t)]]))[0, -1].astype(mx.float32)) for t in ids]
    return np.stack(rows).astype(np.float32)


def mx_dtype_name(a):
    return str(a.dtype).replace("mlx.core.", "")


def describe_weights(path: Path, src_w: dict, spec):
    """Which modules are quantized (with bits/group inferred from shapes), which stayed float,
    norm shift and conv layouts."""
    w = {}
    for f in sorted(path.glob("model*.safetensors")):
        w.update(mx.load(str(f)))
    cfg = json.loads((path / "config.json").read_text())
    q = cfg.get("quantization", {})
    quant, floats = {}, []
    for k, v in w.items():
        if k.endswith(".scales"):
            m = k[: -len(".scales")]
            wq = w[m + ".weight"]
            s = v
            in_dim_groups = s.shape[-1]
            ov = q.get(m, {})
            bits = ov.get("bits", q.get("bits")) if isinstance(ov, dict) else q.get("bits")
            group = ov.get("group_size", q.get("group_size")) if isinstance(ov, dict) else q.get("group_size")
            assert wq.shape[-1] * 32 == in_dim_groups * group * bits, (m, wq.shape, s.shape, bits, group)
            quant[m] = {"bits": bits, "group_size": group, "weight": list(wq.shape),
                        "scales": list(s.shape), "scale_dtype": mx_dtype_name(s),
                        "override": m in q}
    for k, v in w.items():
        if k.endswith(".weight") and v.ndim >= 2 and k[: -len(".weight")] not in quant:
            floats.append(f"{k} {mx_dtype_name(v)} {list(v.shape)}")
    # norm shift: compare 1-D *norm.weight tensors with the source by suffix
    shift = {}
    src_by_suffix = {}
    for k, v in src_w.items():
        src_by_suffix[k.replace("model.language_model.", "").replace("language_model.model.", "")
                      .replace("model.", "", 1)] = v
    for k, v in w.items():
        if v.ndim == 1 and "norm" in k and k.endswith(".weight") and "vision" not in k:
            sk = k.replace("language_model.model.", "").replace("model.", "", 1)
            if sk in src_by_suffix and src_by_suffix[sk].shape == tuple(v.shape):
                a = np.array(v.astype(mx.float32))
                b = src_by_suffix[sk].astype(np.float32)
                if np.allclose(a, b, atol=1e-2):
                    shift[k] = "same"
                elif np.allclose(a, b + 1.0, atol=1e-2):
                    shift[k] = "+1"
                else:
                    shift[k] = "other"
    convs = {}
    for k, v in w.items():
        if v.ndim >= 3 and k.endswith(".weight") and ("conv" in k or "patch_embed" in k or "downsample" in k):
            sk = None
            for cand in src_w:
                if cand.split(".")[-2:] == k.split(".")[-2:] and src_w[cand].ndim == v.ndim \
                        and ("layers." not in k or cand.split("layers.")[-1] == k.split("layers.")[-1]):
                    sk = cand
            convs[k] = {"mlx": list(v.shape),
                        "source": list(src_w[sk].shape) if sk else None}
    return w, cfg, quant, floats, shift, convs


def collapse_shift(shift):
    """Group the per-tensor shift result by the last two name components."""
    out = {}
    for k, v in shift.items():
        parts = k.split(".")
        key = ".".join(p if not p.isdigit() else "*" for p in parts)
        out.setdefault(key, set()).add(v)
    return {k: sorted(v) for k, v in sorted(out.items())}


def float_check(spec, staged: Path, tmp: Path, src_ref: dict):
    """mlx float (unquantized, f32) forward vs the HF reference: is mlx's model the same?"""
    if spec.get("float_adapt"):
        # the quantized fixture's staging changed the model: check on the source's own
        staged = stage(FIX / spec["src"], tmp / ("stage-float-" + spec["name"]))
        spec["float_adapt"](staged)
    dst = tmp / (spec["name"] + "-float")
    if dst.exists():
        shutil.rmtree(dst)
    if spec["conv"] == "lm":
        from mlx_lm import convert as lm_convert
        with naive_detokenizer():
            lm_convert(str(staged), str(dst), dtype="float32")
    else:
        from mlx_vlm.convert import convert as vlm_convert
        vlm_convert(str(staged), str(dst), dtype="float32")
    _, fwd = load_mlx(spec, dst)
    lg = np.array(fwd(src_ref["text.input_ids"]).astype(mx.float32))
    if "text.logits" in src_ref:
        ref = src_ref["text.logits"]
        d = np.abs(lg - ref).max()
        what = "text.logits"
    else:
        ref = src_ref["text.logits_tail"]
        d = np.abs(lg[-ref.shape[0]:] - ref).max()
        what = "text.logits_tail"
    gen, _ = greedy(fwd, src_ref["text.input_ids"])
    same_gen = bool(np.array_equal(gen, src_ref["text.generated_ids"][:N_GEN]))
    out = {"compared": what, "max_abs_diff_vs_hf": float(d), "greedy_equals_hf": same_gen}
    if spec["conv"] == "vlm" and "single.logits_tail" in src_ref:
        kw = image_kwargs(src_ref)
        lg = np.array(fwd(src_ref["single.input_ids"], **kw).astype(mx.float32))
        ref = src_ref["single.logits_tail"]
        gen, _ = greedy(fwd, src_ref["single.input_ids"], **kw)
        out["image_compared"] = "single.logits_tail"
        out["image_max_abs_diff_vs_hf"] = float(np.abs(lg[-ref.shape[0]:] - ref).max())
        out["image_greedy_equals_hf"] = bool(np.array_equal(gen, src_ref["single.generated_ids"]))
    if spec.get("image_case") == "gemma4":
        case = GEMMA4_IMAGE_CASE
        ids, kw = gemma4_image_inputs(dst, spec)
        assert np.array_equal(ids, src_ref[f"{case}.input_ids"]), "mlx-vlm's ids differ from transformers'"
        lg = np.array(fwd(ids, **kw).astype(mx.float32))
        gen, _ = greedy(fwd, ids, **kw)
        out["image_compared"] = f"{case}.logits (ids from mlx-vlm's processor equal transformers')"
        out["image_max_abs_diff_vs_hf"] = float(np.abs(lg - src_ref[f"{case}.logits"]).max())
        out["image_greedy_equals_hf"] = bool(np.array_equal(gen, src_ref[f"{case}.generated_ids"]))
    return out


# The Gemma 4 image case: the source fixture's `nonsquare` prompt and image (50x37, resized by
# the processor keeping its aspect), through mlx-vlm's own processor.
GEMMA4_IMAGE_CASE = "nonsquare"


def gemma4_image_inputs(path: Path, spec):
    """input_ids and the model's keyword inputs from mlx-vlm's Gemma 4 processor (loaded from
    the converted directory) for the source's image case."""
    from PIL import Image
    from mlx_vlm.utils import load_processor
    info = json.loads((FIX / spec["src"] / "reference.json").read_text())["cases"][GEMMA4_IMAGE_CASE]
    proc = load_processor(path, add_detokenizer=False)
    images = [Image.open(FIX / spec["src"] / f).convert("RGB") for f in info["images"]]
    inputs = proc(text=[info["prompt"]], images=images, add_special_tokens=False)
    ids = np.array(inputs["input_ids"])[0].astype(np.int64)
    pv = np.array(inputs["pixel_values"]).astype(np.float32)
    return ids, dict(pixel_values=mx.array(pv))


def image_kwargs(src_ref):
    pv0 = src_ref["single.pixel_values_t0"]  # [P, C*14*14]
    n = pv0.shape[0]
    pv = np.repeat(pv0.reshape(n, 3, 1, 196), 2, axis=2).reshape(n, 3 * 2 * 196)
    return dict(pixel_values=mx.array(pv), image_grid_thw=mx.array(src_ref["single.image_grid_thw"]))


def image_case(spec, src_ref, model_fwd, path: Path):
    if spec.get("image_case") == "gemma4":
        ids, kw = gemma4_image_inputs(path, spec)
        lg = np.array(model_fwd(ids, **kw).astype(mx.float32))
        gen, margins = greedy(model_fwd, ids, **kw)
        return {"image.input_ids": ids, "image.pixel_values": np.array(kw["pixel_values"]),
                "image.logits": lg, "image.generated_ids": gen}, margins
    if "single.pixel_values_t0" not in src_ref:
        return None
    ids = src_ref["single.input_ids"]
    grid = src_ref["single.image_grid_thw"]
    kw = image_kwargs(src_ref)
    lg = np.array(model_fwd(ids, **kw).astype(mx.float32))
    gen, margins = greedy(model_fwd, ids, **kw)
    return {"image.input_ids": ids.astype(np.int64), "image.image_grid_thw": grid.astype(np.int64),
            "image.logits_tail": lg[-4:], "image.generated_ids": gen}, margins


def layer_example(w, quant):
    """Names/dtypes/shapes of the non-layer text tensors and of one decoder layer of each kind
    (a layer is shown when its key suffixes differ from every layer shown before)."""
    import re
    out, seen, shown = [], [], set()
    layers = {}
    for k in w:
        m = re.match(r"(.*\.layers\.)(\d+)\.(.*)", k)
        if m and "vision" not in k:
            layers.setdefault(int(m.group(2)), []).append(k)
    for i in sorted(layers):
        sig = sorted(re.sub(r".*\.layers\.\d+\.", "", k) for k in layers[i])
        if sig not in seen:
            seen.append(sig)
            shown.update(layers[i])
    for k in sorted(w):
        if k in shown or (".layers." not in k and "vision" not in k and "visual" not in k):
            out.append(f"{k} {mx_dtype_name(w[k])} {list(w[k].shape)}")
    return out


def make_fixture(spec, tmp: Path):
    name = spec["name"]
    src = FIX / spec["src"]
    staged = stage(src, tmp / ("stage-" + name))
    adapt = spec.get("adapt", ADAPT.get(spec["src"]))
    adaptations = adapt(staged) if adapt else []
    dst = OUT / name
    if dst.exists():
        shutil.rmtree(dst)
    convert(spec, staged, dst)

    src_w = {}
    for f in sorted(src.glob("model*.safetensors")):
        src_w.update({k: v.astype(np.float32) if v.dtype != np.float32 else v
                      for k, v in _load_any(f).items()})
    w, cfg, quant, floats, shift, convs = describe_weights(dst, src_w, spec)

    src_ref = load_file(str(src / "reference.safetensors"))
    ids = src_ref["text.input_ids"].astype(np.int64)
    model, fwd = load_mlx(spec, dst)
    logits = np.array(fwd(ids).astype(mx.float32))
    gen, margins = greedy(fwd, ids)
    # the greedy path's first token is the argmax of the full-sequence logits
    assert gen[0] == int(np.argmax(logits[-1]))
    ref = {"input_ids": ids, "logits": logits.astype(np.float32), "generated_ids": gen}
    if spec.get("stepped"):
        ref["logits_stepped"] = stepped_logits(spec, model, ids)
    img_margins = None
    if spec["conv"] == "vlm" and spec.get("image_case", True):
        r = image_case(spec, src_ref, fwd, dst)
        if r is not None:
            img, img_margins = r
            ref.update(img)
    f32_margins = None
    if spec.get("dtype") == "bfloat16":
        # what an f32 engine computes from this checkpoint: every bf16 tensor (scales, biases,
        # norms) widened exactly to f32, codes unchanged, f32 activations
        from mlx.utils import tree_map
        m32, fwd32 = load_mlx(spec, dst)
        m32.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                            m32.parameters()))
        ref["logits_f32"] = np.array(fwd32(ids).astype(mx.float32))
        ref["generated_ids_f32"], f32_margins = greedy(fwd32, ids)
    save_file(ref, str(dst / "reference.safetensors"))

    fc = float_check(spec, staged, tmp, src_ref)
    # dequantised model (the converters' own dequantize_model) run by mlx: same logits?
    if spec["conv"] == "lm":
        from mlx_lm.utils import dequantize_model
    else:
        from mlx_vlm.quant_utils import dequantize_model
    dequantize_model(model)
    fc["dequantized_model_max_abs_diff_vs_logits"] = float(
        np.abs(np.array(fwd(ids).astype(mx.float32)) - logits).max())
    qcfg = cfg.get("quantization")
    info = {
        "name": name,
        "source": f"tests/fixtures/{spec['src']}",
        "converter": "mlx_lm.convert" if spec["conv"] == "lm" else "mlx_vlm.convert.convert",
        "convert_args": {"quantize": True, "q_bits": spec["bits"], "q_group_size": spec["group"],
                         "dtype": spec.get("dtype", "float32"),
                         "quant_predicate": spec.get("recipe"),
                         "vision_tower_kept_in_source_dtype": bool(spec.get("vision_source_dtype"))},
        "source_adaptations": adaptations,
        "config_quantization": qcfg,
        "quantization_config_equals_quantization": cfg.get("quantization_config") == qcfg,
        "quantized_modules": quant,
        "float_matrices": floats,
        "norms": collapse_shift(shift),
        "convs": convs,
        "key_prefixes": sorted({".".join(k.split(".")[:2]) for k in w}),
        "layer_example": layer_example(w, quant),
        "reference": {
            "input_ids_from": f"{spec['src']}/reference.safetensors text.input_ids",
            "generated_ids": gen.tolist(),
            "min_top1_top2_margin": min(margins),
            "margins": [round(m, 6) for m in margins],
            "f32_widened": None if f32_margins is None else {
                "keys": "logits_f32, generated_ids_f32: the same checkpoint with every bf16 tensor "
                        "widened to f32 and f32 compute",
                "generated_ids": ref["generated_ids_f32"].tolist(),
                "min_top1_top2_margin": min(f32_margins),
                "max_abs_diff_logits_vs_bf16": float(np.abs(ref["logits_f32"] - logits).max())},
            "stepped": None if "logits_stepped" not in ref else {
                "keys": "logits_stepped: mlx's logits fed one token at a time through its own "
                        "cache (make_prompt_cache / make_cache)",
                "max_abs_diff_vs_logits": float(np.abs(ref["logits_stepped"] - logits).max())},
            "image_case": None if img_margins is None else {
                "from": (f"{spec['src']}/reference.json cases.{GEMMA4_IMAGE_CASE} prompt and image "
                         "through mlx-vlm's processor" if spec.get("image_case") == "gemma4" else
                         f"{spec['src']}/reference.safetensors single.* (pixel_values_t0 "
                         "repeated over the temporal axis)"),
                "generated_ids": ref["image.generated_ids"].tolist(),
                "min_top1_top2_margin": min(img_margins)},
        },
        "float_check": fc,
        "versions": versions(),
    }
    (dst / "reference.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def _load_any(f: Path):
    # bf16 source weights: read through mlx (numpy has no bf16)
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()}


def versions():
    import importlib.metadata as md
    return {p: md.version(p) for p in ("mlx", "mlx-lm", "mlx-vlm", "transformers", "tokenizers",
                                       "safetensors", "numpy")}


README_HEAD = """\
# MLX fixtures

Made by `scripts/make_mlx_fixtures.py` (offline, CPU, ~10 s on 2 cores) with mlx 0.32.4 (`mlx[cpu]`),
mlx-lm 0.32.2, mlx-vlm 0.7.10, transformers 5.24.0, tokenizers 0.23.3, safetensors 0.8.0,
numpy 2.4.6 (Python 3.11, Linux x86-64). No torch. Output is byte-identical across runs.

```sh
python3 -m venv /work/venv-mlx && /work/venv-mlx/bin/pip install "mlx[cpu]" mlx-lm mlx-vlm
/work/venv-mlx/bin/python scripts/make_mlx_fixtures.py          # everything
/work/venv-mlx/bin/python scripts/make_mlx_fixtures.py NAME...  # some fixtures (README not rewritten)
```

## `quant_vectors.safetensors`

`mx.quantize(w, group_size=G, bits=B)` (affine) test vectors, for B in {2,3,4,5,6,8} x G in
{32,64,128}, prefix `b{B}_g{G}` for `w` [3, 3G] (three groups per row, so 3/5/6-bit codes also
straddle u32 words at group boundaries) and `b{B}_g{G}.r5` for `w` [5, G]. Keys per prefix:
`.w` (f32 input; row 0 all positive, row 1 all negative, `w[2,5] = 0`), `.w_q` (uint32
`[rows, cols*B/32]`, exactly what mx.quantize returns), `.scales`, `.biases` (f32
`[rows, cols/G]`; negative scales occur), `.dequant` (`mx.dequantize` in f32).
`b4_g64_bf16.*`: `w` [3,192] cast to bf16 first, so scales/biases are bf16 (stored here widened to
f32, exact) and `.dequant` is mlx's bf16 dequant widened to f32.

## Converted models `<name>/`

Each directory is a converter's output (config.json, model.safetensors,
model.safetensors.index.json, which both converters write even for one shard, tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json; mlx-vlm also writes
processor_config.json, kept only where the source has a processor config, and copies
preprocessor_config.json) plus `reference.safetensors` and
`reference.json`. The model card README.md the converters write is deleted.

`reference.safetensors`, from mlx's own forward on the converted directory (`mlx_lm.load` /
`mlx_vlm.load`, CPU, no cache):
`input_ids` [T] int64 (the source fixture's `text.input_ids`), `logits` [T, V] f32 (full
sequence; for the bf16 fixture mlx's bf16 logits widened), `generated_ids` [10] int64 (greedy
argmax, first index on ties, re-running the full forward each step, not stopping at EOS). The
Qwen2-VL / Qwen2.5-VL fixtures add an image case built from the source fixture's `single` case:
`image.input_ids`, `image.image_grid_thw`, `image.logits_tail` [4, V] (last 4 rows),
`image.generated_ids` [10]; pixel values are the source's `single.pixel_values_t0` repeated over
the temporal axis (`[P, 3, 1, 196] -> [P, 3, 2, 196] -> [P, 1176]`). VLM text references call
`model.language_model(input_ids)` (text positions, so M-RoPE = plain RoPE), resetting mlx-vlm's
cached `_position_ids` / `_rope_deltas` before each call. `llama-4bit-g64-bf16` adds `logits_f32`
and `generated_ids_f32` (see the notes at the end).

`reference.json`: convert arguments, source adaptations, the config's `quantization` block, every
quantized module with bits / group / shapes / scale dtype, every float matrix, norm shift,
conv layouts, the key prefixes, `layer_example` (names / dtypes / shapes of the non-layer text
tensors and one decoder layer of each kind), greedy margins, and `float_check`: the same
converter run **without** quantization (f32) compared to the source HF reference, i.e. whether
mlx's model computes what transformers does.

### Layout facts (all fixtures)

- Quantized module `M`: `M.weight` uint32 `[.., out, in*bits/32]`, `M.scales` and `M.biases`
  `[.., out, in/group]` in the model dtype (f32 here except `llama-4bit-g64-bf16`); a Linear's own
  bias stays `M.bias` float. MoE experts are stacked `switch_mlp.{gate,up,down}_proj` with
  `weight` `[E, out, in*bits/32]`, `scales`/`biases` `[E, out, in/group]`.
- Prefixes: mlx-lm text models `model.*` (+ `lm_head.*` when untied); mlx-vlm (VLMs and
  Qwen3.5, also the text-only `qwen3_5_text`) `language_model.model.*`,
  `language_model.lm_head.*` when untied, `vision_tower.*`. Tied models have no lm_head tensor:
  the head is the (quantized) embedding.
- config.json: `quantization` = `{group_size, bits, mode: "affine"}` plus one entry per module
  whose predicate returned a dict (key = MLX module path without `.weight`); modules the predicate
  refused are absent from both the config and `.scales` (detect by `.scales` presence);
  `quantization_config` is an identical copy. mlx-vlm writes `generation_config` nested into
  config.json, adds `"vision_config": {}` to the text-only Qwen3.5, and keeps the source's
  top-level `dtype` unchanged (VLM configs say `bfloat16` while the tensors are f32;
  `llama-4bit-g64-bf16` says `float32` while its tensors are bf16): trust tensor dtypes.
- Layers whose input dim is not divisible by the group (or by an override's group) stay float:
  with hidden 64, group 128 would leave most layers float (no such fixture: 680 KB; group 128 is
  exercised by `llama-mixed`'s down_proj override), and in `qwen3.5-moe-4bit` the expert and
  shared-expert `down_proj` (inputs 16 and 24) are float.
- Norm shift: only the Qwen3.5 family stores `1 + w_hf` for `input_layernorm`,
  `post_attention_layernorm`, `model.norm`, `q_norm`, `k_norm` (MLX then uses plain `x*w`);
  `linear_attn.norm` is not shifted. Gemma3 norms are stored unshifted (mlx-lm's gemma RMSNorm
  computes `1 + w` at runtime). Llama / Qwen2 / Qwen3 / GLM norms are plain and unchanged.
- Conv layouts (unquantized, channels last): vision `patch_embed.proj.weight` Conv3d
  `[O, C, T, kh, kw] -> [O, T, kh, kw, C]`; GLM `vision_tower.downsample.weight` Conv2d
  `[O, C, kh, kw] -> [O, kh, kw, C]`; Qwen3.5 GDN `linear_attn.conv1d.weight` `[C, 1, K] -> [C, K, 1]`.
  `A_log` stays f32 (cast_predicate).

### Converter problems and adaptations

- Both converters glob `*.safetensors`, so the source is first copied to a staging directory
  without `reference.safetensors` and images.
- mlx-lm 0.32.2 cannot convert `tiny-qwen3.5` (`ValueError: Model type qwen3_5_text not
  supported.`) nor `tiny-qwen3.5-moe` (its `qwen3_5_moe.sanitize` expects fused
  `experts.gate_up_proj`; the per-expert tensors give `ValueError: Received 96 parameters not in
  model`), so both Qwen3.5 fixtures come from mlx-vlm.
- `tiny-qwen2-vl`: mlx-vlm's qwen2_vl needs the flat hub config (`TypeError: TextConfig.__init__()
  missing 6 required positional arguments` on the transformers-5 nested form) and
  `vision_config.model_type == "qwen2_vl"`: staged with the text fields at top level,
  `rope_theta` + `rope_scaling {type: mrope, mrope_section}`, vision model_type `qwen2_vl`.
- `tiny-qwen2.5-vl`: `ValueError: Unsupported model type: qwen2_5_vl_vision` (vision model_type
  set to `qwen2_5_vl`), and mlx-vlm's sanitize maps only the hub weight names, so the staged
  weights are renamed `model.language_model.* -> model.*`, `model.visual.* -> visual.*`.
- `tiny-glm4v`: `ValueError: Received 2 parameters not in model: vision_tower.blocks.{0,1}.attn.qkv.bias`
  (mlx-vlm's glm4v vision attention has no qkv bias): dropped in staging (text unaffected).
- `tiny-glm4v-moe`: `TypeError: TextConfig.__init__() missing 1 required positional argument:
  'use_qk_norm'`: `use_qk_norm: false` added.
- GLM image case not made: mlx-vlm's glm4v / glm4v_moe image path does not reproduce
  transformers' on these fixtures (float conversion, `single` case: max |dlogits_tail| 8.6 and 5.6;
  for glm4v-moe the vision tower output differs by up to 0.5 from `single.image_embeds`, and
  mlx-vlm's rope index looks for `vision_start_token_id` (absent from GLM configs, which call it
  `image_start_token_id`; its default 151339 is the real GLM-4.xV id)). The GLM vision towers are kept
  in the source bf16 (the converter's cast_predicate is wrapped to skip `vision_tower.*`) to save
  space; their text is f32. The GLM processor adds `<|begin_of_box|>`=467 / `<|end_of_box|>`=468
  to tokenizer.json (not in the source tokenizer).
- `qwen3.5-moe-4bit`: hidden 32, so group 32; mlx-vlm's own MoE predicate returns
  `{group_size: 64, bits: 8}` for `mlp.gate` / `shared_expert_gate`, which cannot apply to
  inputs of 32 (those layers would silently stay float), so a copy of that predicate with
  group 32 is passed (real checkpoints: group 64).

## Per-fixture facts
"""


README_TAIL = """\
## Notes for tests

- Greedy equality is fragile where the margin is small: `llama-4bit-g64-bf16` step 1 is an exact
  tie in mlx's bf16 logits (tokens 112 and 809 both 5.6875; mlx's and numpy's argmax take the
  first index, 112), so only its logits (bf16 tolerance) and step 0 are robust; `qwen2.5-vl-4bit`
  image case has a margin of 1.8e-4; `glm4v-4bit` (2.2e-3 at step 1), `gemma3-4bit-g64`
  (2.6e-3 at step 2) and `qwen3-4bit-g64` (6.6e-3 at steps 8-9) need f32 agreement to ~1e-3.
- mlx (CPU) running the converter's `dequantize_model` of each f32 fixture reproduces `logits`
  exactly (last column), so `logits` is "dequantise, then the f32 float model". In bf16 it does
  not (0.51: bf16 rounding of the dequantised weights and of the activations).
- `llama-4bit-g64-bf16/reference.safetensors` also has `logits_f32` / `generated_ids_f32`: the same
  checkpoint with every bf16 tensor widened (exactly) to f32 and f32 compute, i.e. what an f32
  engine should produce from it (its max difference from the bf16 `logits` is 0.70 and the argmax
  differs at 5 of 30 positions, so compare an f32 engine against `logits_f32`);
  `generated_ids_f32` equals `generated_ids` and its smallest margin is 3.4e-3.
- The float check shows mlx's models equal transformers' to ~1e-5 for every fixture except
  Qwen3.5 (4e-4 dense, 4e-5 MoE; presumably mlx's GDN kernel vs transformers' chunked path), so a
  dequantise-then-f32 implementation should match `logits` to roughly 1e-4 (f32 fixtures).
- `qwen3-4bit-g64`'s source is sharded; mlx-lm writes one `model.safetensors` (+ index).
- mlx-vlm's glm4v_moe router `mlp.gate` is not a Linear in MLX: it stays float (f32) with
  `mlp.gate.e_score_correction_bias`; Qwen3.5-MoE's `mlp.gate` is a Linear and is quantized (8-bit).
"""


def fmt_q(q):
    return "/".join(str(x) for x in q)


def write_readme(results, qmeta, failed):
    import re
    lines = [README_HEAD]
    lines.append("`min margin` is the smallest top-1 minus top-2 logit along the greedy path; "
                 "`float check` is the same conversion without quantization, in f32 (also for the "
                 "bf16 fixture), against the source's HF logits (VLMs: `text.logits_tail`).\n")
    lines.append("| fixture | source | converter, recipe | `quantization` (+ overrides) | "
                 "min margin (text / image) | float check: max abs dlogits vs HF, greedy | "
                 "dequantized model vs `logits` |")
    lines.append("|---|---|---|---|---|---|---|")
    for n, r in results.items():
        q = r["config_quantization"]
        base = {k: v for k, v in q.items() if not isinstance(v, dict)}
        nov = sum(isinstance(v, dict) for v in q.values())
        ca = r["convert_args"]
        rec = ("mlx-lm" if r["converter"].startswith("mlx_lm") else "mlx-vlm") + \
            f", {ca['q_bits']}-bit g{ca['q_group_size']} {ca['dtype']}" + \
            (f", {ca['quant_predicate']}" if ca["quant_predicate"] else "")
        im = r["reference"]["image_case"]
        fc = r["float_check"]
        lines.append(
            f"| `{n}` | {r['source'].split('/')[-1]} | {rec} | `{json.dumps(base)}` (+{nov}) | "
            f"{r['reference']['min_top1_top2_margin']:.4g}"
            + (f" / {im['min_top1_top2_margin']:.4g}" if im else "")
            + f" | {fc['max_abs_diff_vs_hf']:.2g}, {'equal' if fc['greedy_equals_hf'] else 'DIFFERS'}"
            + f" | {fc['dequantized_model_max_abs_diff_vs_logits']:.2g} |")
    lines.append("")
    for n, r in results.items():
        lines.append(f"### `{n}`\n")
        ov = {k: v for k, v in r["config_quantization"].items() if isinstance(v, dict)}
        if ov:
            lines.append("Overrides in config: " + ", ".join(
                f"`{k}` {v['bits']}/{v['group_size']}" for k, v in ov.items()) + ".\n")
        cls = {}
        for m, qq in r["quantized_modules"].items():
            c = re.sub(r"\.\d+\.", ".*.", m)
            cls.setdefault(c, set()).add((qq["bits"], qq["group_size"]))
        sd = sorted({qq["scale_dtype"] for qq in r["quantized_modules"].values()})
        lines.append(f"Quantized (bits/group), scales {'/'.join(sd)}: " + ", ".join(
            f"`{c}` " + " and ".join(fmt_q(x) for x in sorted(v)) for c, v in sorted(cls.items()))
            + ".\n")
        fl = {}
        for f in r["float_matrices"]:
            k, dt, _ = f.split(" ", 2)
            c = "vision_tower.*" if k.startswith("vision_tower") else re.sub(r"\.\d+\.", ".*.", k)
            fl.setdefault(c, set()).add(dt)
        lines.append("Float matrices: " + (", ".join(
            f"`{c}` {'/'.join(sorted(v))}" for c, v in sorted(fl.items())) or "none") + ".\n")
        sh = [k for k, v in r["norms"].items() if "+1" in v]
        lines.append("Prefixes: " + ", ".join(f"`{p}`" for p in r["key_prefixes"]) + ". Norms: "
                     + ("shifted (+1): " + ", ".join(f"`{k}`" for k in sh) + "; others unchanged"
                        if sh else "stored as in the source (unshifted)") + ".\n")
        cv = {k: v for k, v in r["convs"].items() if ".layers." not in k or ".layers.0." in k}
        if cv:
            lines.append("Convs: " + ", ".join(
                f"`{k}` {v['source']} -> {v['mlx']}" for k, v in cv.items()) + ".\n")
        if r["source_adaptations"]:
            lines.append("Staging: " + "; ".join(r["source_adaptations"]) + ".\n")
        ref = r["reference"]
        ms = ref["margins"]
        lines.append(f"generated_ids {ref['generated_ids']}; margins {ms} (min {min(ms):.4g} at "
                     f"step {ms.index(min(ms))})" + (
                         f"; image generated_ids {ref['image_case']['generated_ids']} (min margin "
                         f"{ref['image_case']['min_top1_top2_margin']:.4g})"
                         if ref["image_case"] else "") + ".\n")
    lines.append(README_TAIL)
    if failed:
        lines.append("## Failed\n")
        for k, v in failed.items():
            lines.append(f"- `{k}`: {v}")
    (OUT / "README.md").write_text("\n".join(lines) + "\n")


def main():
    only = set(sys.argv[1:])
    OUT.mkdir(parents=True, exist_ok=True)
    summary = {"versions": versions()}
    if not only or "quant" in only:
        summary["quant_vectors"] = make_quant_vectors()
    results, failed = {}, {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for spec in SPECS:
            if only and spec["name"] not in only and "all" not in only:
                continue
            print(f"=== {spec['name']}", flush=True)
            try:
                results[spec["name"]] = make_fixture(spec, tmp)
            except Exception as e:  # record and go on
                import traceback
                traceback.print_exc()
                failed[spec["name"]] = f"{type(e).__name__}: {e}"
                shutil.rmtree(OUT / spec["name"], ignore_errors=True)
    summary["fixtures"] = {k: {"converter": v["converter"], "convert_args": v["convert_args"],
                               "min_top1_top2_margin": v["reference"]["min_top1_top2_margin"],
                               "image_min_margin": (v["reference"]["image_case"] or {}).get(
                                   "min_top1_top2_margin"),
                               "float_check": v["float_check"]}
                           for k, v in results.items()}
    summary["failed"] = failed
    if not only:
        write_readme(results, summary.get("quant_vectors"), failed)
    total = 0
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            total += p.stat().st_size
    for d in sorted(OUT.iterdir()):
        sz = sum(p.stat().st_size for p in d.rglob("*")) if d.is_dir() else d.stat().st_size
        print(f"{sz:>9} {d.relative_to(FIX)}")
    print(f"{total:>9} total")
    if failed:
        print("FAILED:", json.dumps(failed, indent=1))


if __name__ == "__main__":
    main()
