#!/usr/bin/env python3
"""Memory soak of `iris serve`: continuous mixed load for a while, watching the server's RSS.

Starts `iris serve` (release build, the default SmolLM2 model unless --model), then runs
--clients threads that send requests back to back until --duration seconds have passed. Each
request is drawn (seeded, so runs are reproducible in kind) from this mix:

- OpenAI chat, streaming and not; OpenAI completions, streaming and not (some with n=2, some
  with echo + logprobs); Anthropic messages, streaming and not; greedy or seeded sampling,
  2..96 tokens; all checked: HTTP 200, a well-formed body or stream to its end ([DONE] /
  message_stop), a finish reason, usage no larger than asked;
- a streaming request whose client disconnects after its first content chunk;
- bad requests (malformed JSON, invalid UTF-8, unknown model, max_tokens 0, prompt + max_tokens
  over the context, empty messages, unknown role, Anthropic without max_tokens), each checked
  for its expected 4xx status and an error body.

Meanwhile a sampler reads VmRSS from /proc/PID/status (and KV block use from /metrics) every
--sample-every seconds.

Pass/fail (exit status 0 only if all hold):
1. No good request failed and every bad request got its expected status.
2. Memory: after the warm-up (--warmup seconds), RSS does not grow: the largest RSS sample of
   the last minute is at most the largest sample of the first minute after the warm-up plus
   --bound-mb MB.
3. After the load stops, /metrics shows every KV block free and no sequence running or waiting.
4. SIGTERM then stops the server with exit status 0.

Why a small KV pool by default (--kv-cache-memory 32MiB): the pool is allocated zeroed, so its
pages become resident only when a block is first used; the block allocator reuses the most
recently freed blocks first, so resident KV pages grow only up to the peak number of blocks in
use at once. With a pool smaller than the load's peak demand, the whole pool is in use (and
sequences are preempted) during the warm-up, and KV pages cannot masquerade as growth later;
what can still grow is the heap, which is what this soak is about. Preemption gets exercised too.

Usage:
    cargo build --release
    python3 scripts/soak.py                      # 10 minutes, default model
    python3 scripts/soak.py --duration 120 --warmup 30 --model tests/fixtures/tiny-llama   # smoke
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash map is to a beginner programmer.",
    "List five animals that live in the ocean.",
    "Why does ice float on water?",
    "Give three tips for writing clear emails.",
    "What is the tallest mountain in the world, and how tall is it?",
    "Describe the water cycle in a few sentences.",
]


class Failures:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}

    def add(self, kind, msg):
        key = f"{kind}: {msg[:300]}"
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def total(self):
        with self.lock:
            return sum(self.counts.values())


class Server:
    def __init__(self, args):
        cmd = [args.iris_bin, "serve", "--port", "0", "--kv-cache-memory", args.kv_cache_memory]
        if args.model:
            cmd += ["--model", args.model]
        cmd += args.serve_args
        env = dict(os.environ, RUST_LOG="iris=info", NO_COLOR="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.log = []
        self.addr = None
        ready = threading.Event()

        def read_log():
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                m = re.search(r"listening on http://(\S+)", line)
                if m and self.addr is None:
                    self.addr = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read_log, daemon=True).start()
        if not ready.wait(300) or self.addr is None:
            self.proc.kill()
            sys.exit("the server did not start:\n" + "\n".join(self.log[-20:]))
        self.host, port = self.addr.rsplit(":", 1)
        self.port = int(port)
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                sys.exit("the server exited while loading:\n" + "\n".join(self.log[-20:]))
            time.sleep(0.2)
        sys.exit("the server never became healthy")

    def conn(self, timeout=300):
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None):
        c = self.conn()
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            h = {"Content-Type": "application/json"} if body is not None else {}
            h.update(headers or {})
            c.request(method, path, body=body, headers=h)
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def metrics(self):
        status, body = self.request("GET", "/metrics")
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                parts = line.split()
                if len(parts) == 2:
                    try:
                        out[parts[0]] = float(parts[1])
                    except ValueError:
                        pass
        return out

    def rss_kb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")


def sse_events(resp):
    """Yields (event name, data) of an SSE response as they arrive."""
    event, data = None, []
    while True:
        line = resp.readline()
        if not line:
            return
        line = line.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])


class Client:
    def __init__(self, server, rng, failures, stats, max_model_len):
        self.s, self.rng, self.failures, self.stats = server, rng, failures, stats
        self.max_model_len = max_model_len

    def sampling(self):
        p = {"max_tokens": self.rng.randint(2, 96)}
        if self.rng.random() < 0.5:
            p["temperature"] = 0
        else:
            p.update(temperature=0.8, top_p=0.95, seed=self.rng.randint(0, 10**6))
        if self.rng.random() < 0.5:
            p["ignore_eos"] = True
        return p

    def messages(self):
        msgs = [{"role": "user", "content": self.rng.choice(PROMPTS)}]
        if self.rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "You are a concise assistant."})
        return msgs

    def post(self, path, body, stream):
        c = self.s.conn()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        return c, c.getresponse()

    def fail(self, kind, msg):
        self.failures.add(kind, msg)

    def check_usage(self, kind, usage, max_tokens, n=1, key="completion_tokens"):
        got = usage.get(key) if usage else None
        if got is None or got < 1 or got > max_tokens * n:
            self.fail(kind, f"usage {usage} for max_tokens {max_tokens} x {n}")
            return False
        return True

    # --- good requests -------------------------------------------------------------------
    def chat(self, stream):
        kind = "chat_stream" if stream else "chat"
        p = self.sampling()
        body = {"messages": self.messages(), **p}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        c, r = self.post("/v1/chat/completions", body, stream)
        try:
            if r.status != 200:
                return self.fail(kind, f"HTTP {r.status}: {r.read()[:300]!r}")
            if not stream:
                v = json.loads(r.read())
                ch = v["choices"][0]
                if ch["finish_reason"] not in ("stop", "length") or not isinstance(ch["message"]["content"], str):
                    return self.fail(kind, f"bad body {str(v)[:300]}")
                return self.check_usage(kind, v.get("usage"), p["max_tokens"])
            done, finish, usage = False, None, None
            for _, d in sse_events(r):
                if d == "[DONE]":
                    done = True
                    continue
                v = json.loads(d)
                if "error" in v:
                    return self.fail(kind, f"error in stream: {v}")
                if v.get("usage"):
                    usage = v["usage"]
                for ch in v["choices"]:
                    finish = ch.get("finish_reason") or finish
            if not done or finish not in ("stop", "length"):
                return self.fail(kind, f"stream ended badly (done={done}, finish={finish})")
            return self.check_usage(kind, usage, p["max_tokens"])
        finally:
            c.close()

    def completion(self, stream):
        kind = "completion_stream" if stream else "completion"
        p = self.sampling()
        n = 2 if self.rng.random() < 0.25 else 1
        body = {"prompt": self.rng.choice(PROMPTS), "n": n, **p}
        if self.rng.random() < 0.25:
            body.update(echo=True, logprobs=2)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        c, r = self.post("/v1/completions", body, stream)
        try:
            if r.status != 200:
                return self.fail(kind, f"HTTP {r.status}: {r.read()[:300]!r}")
            if not stream:
                v = json.loads(r.read())
                if len(v["choices"]) != n or any(ch["finish_reason"] not in ("stop", "length")
                                                 for ch in v["choices"]):
                    return self.fail(kind, f"bad body {str(v)[:300]}")
                if body.get("echo"):
                    lp = v["choices"][0]["logprobs"]["token_logprobs"]
                    if lp[0] is not None or any(x is None for x in lp[1:]):
                        return self.fail(kind, f"echo logprobs {lp[:5]}")
                return self.check_usage(kind, v.get("usage"), p["max_tokens"], n)
            done, finishes, usage = False, set(), None
            for _, d in sse_events(r):
                if d == "[DONE]":
                    done = True
                    continue
                v = json.loads(d)
                if "error" in v:
                    return self.fail(kind, f"error in stream: {v}")
                if v.get("usage"):
                    usage = v["usage"]
                for ch in v["choices"]:
                    if ch.get("finish_reason"):
                        finishes.add(ch["index"])
            if not done or len(finishes) != n:
                return self.fail(kind, f"stream ended badly (done={done}, finished={finishes})")
            return self.check_usage(kind, usage, p["max_tokens"], n)
        finally:
            c.close()

    def messages_api(self, stream):
        kind = "messages_stream" if stream else "messages"
        p = self.sampling()
        body = {"max_tokens": p["max_tokens"], "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}]}
        if "seed" in p:
            body.update(temperature=0.8, top_p=0.95)
        else:
            body["temperature"] = 0
        if self.rng.random() < 0.3:
            body["system"] = "Answer briefly."
        if stream:
            body["stream"] = True
        c, r = self.post("/v1/messages", body, stream)
        try:
            if r.status != 200:
                return self.fail(kind, f"HTTP {r.status}: {r.read()[:300]!r}")
            if not stream:
                v = json.loads(r.read())
                if v.get("type") != "message" or v.get("stop_reason") not in ("end_turn", "max_tokens", "stop_sequence"):
                    return self.fail(kind, f"bad body {str(v)[:300]}")
                return self.check_usage(kind, v.get("usage"), p["max_tokens"], key="output_tokens")
            names = [e for e, _ in sse_events(r)]
            want = ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
            if [e for e in names if e in want] != want:
                return self.fail(kind, f"events {names[:3]}...{names[-3:]}")
            return True
        finally:
            c.close()

    def disconnect(self):
        kind = "disconnect"
        body = {"messages": self.messages(), "max_tokens": 512, "ignore_eos": True, "temperature": 0, "stream": True}
        c, r = self.post("/v1/chat/completions", body, True)
        try:
            if r.status != 200:
                return self.fail(kind, f"HTTP {r.status}: {r.read()[:300]!r}")
            for _, d in sse_events(r):
                v = json.loads(d)
                if any(ch.get("delta", {}).get("content") for ch in v.get("choices", [])):
                    break
            return True
        finally:
            c.close()  # mid-stream: the server must cancel the sequence and free its blocks

    # --- bad requests --------------------------------------------------------------------
    def bad(self):
        user = [{"role": "user", "content": "hi"}]
        cases = [
            ("/v1/chat/completions", b'{"messages": [', 400),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
            ("/v1/chat/completions", {"model": "no-such-model", "messages": user}, 404),
            ("/v1/chat/completions", {"messages": user, "max_tokens": 0}, 400),
            ("/v1/chat/completions", {"messages": user, "max_tokens": self.max_model_len}, 400),
            ("/v1/chat/completions", {"messages": []}, 400),
            ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
            ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
            ("/v1/messages", {"messages": user}, 400),
        ]
        path, body, want = self.rng.choice(cases)
        c, r = self.post(path, body, False)
        try:
            raw = r.read()
            if r.status != want:
                return self.fail("bad_request", f"{path} {body!r:.80}: HTTP {r.status}, expected {want}")
            try:
                v = json.loads(raw)
            except ValueError:
                return self.fail("bad_request", f"{path}: error body is not JSON: {raw[:200]!r}")
            if not isinstance(v.get("error"), dict) or not v["error"].get("message"):
                return self.fail("bad_request", f"{path}: no error message in {v}")
            return True
        finally:
            c.close()

    MIX = [("chat", 3), ("chat_stream", 4), ("completion", 2), ("completion_stream", 2),
           ("messages", 2), ("messages_stream", 2), ("disconnect", 2), ("bad", 3)]

    def one(self):
        names = [m for m, _ in self.MIX]
        kind = self.rng.choices(names, weights=[w for _, w in self.MIX])[0]
        try:
            if kind.startswith("chat"):
                self.chat(kind.endswith("stream"))
            elif kind.startswith("completion"):
                self.completion(kind.endswith("stream"))
            elif kind.startswith("messages"):
                self.messages_api(kind.endswith("stream"))
            elif kind == "disconnect":
                self.disconnect()
            else:
                self.bad()
        except Exception as e:  # connection errors, bad JSON: a failed request
            self.fail(kind, f"{type(e).__name__}: {e}")
        with self.stats["lock"]:
            self.stats[kind] = self.stats.get(kind, 0) + 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--warmup", type=float, default=120, help="seconds before RSS must stop growing (default 120)")
    ap.add_argument("--bound-mb", type=float, default=16.0,
                    help="allowed RSS growth: last-minute max <= first-minute-after-warmup max + this (default 16)")
    ap.add_argument("--clients", type=int, default=12, help="concurrent client threads (default 12)")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    ap.add_argument("--iris-bin", default=str(REPO / "target" / "release" / "iris"))
    ap.add_argument("--model", help="model path (default: the server's default model)")
    ap.add_argument("--kv-cache-memory", default="32MiB", help="KV pool (default 32MiB; see the docstring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", help="write the samples and counts here")
    ap.add_argument("serve_args", nargs="*", help="extra `iris serve` flags (after --)")
    args = ap.parse_args()
    if args.duration < args.warmup + 60:
        sys.exit("--duration must leave at least a minute after --warmup")

    server = Server(args)
    print(f"server pid {server.proc.pid} at {server.addr}; " + next(
        (l.split("INFO", 1)[-1].strip() for l in server.log if "KV cache" in l), ""), flush=True)
    status, body = server.request("GET", "/v1/models")
    max_model_len = json.loads(body)["data"][0]["max_model_len"]

    failures, stats = Failures(), {"lock": threading.Lock()}
    samples = []  # (t, rss_mb, kv_used, kv_total)
    t0 = time.time()
    stop_at = t0 + args.duration
    stop_sampling = threading.Event()

    def sampler():
        while not stop_sampling.is_set():
            t = time.time() - t0
            try:
                m = server.metrics()
                kv = (m.get("iris_kv_cache_blocks_used"), m.get("iris_kv_cache_blocks_total"))
            except OSError:
                kv = (None, None)
            samples.append((t, server.rss_kb() / 1024, *kv))
            stop_sampling.wait(args.sample_every)

    def client(i):
        cl = Client(server, random.Random(args.seed * 1000 + i), failures, stats, max_model_len)
        while time.time() < stop_at:
            cl.one()

    threads = [threading.Thread(target=sampler, daemon=True)]
    threads += [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    last_report = t0
    while any(t.is_alive() for t in threads[1:]):
        time.sleep(1)
        if time.time() - last_report >= 60:
            last_report = time.time()
            s = samples[-1] if samples else None
            with stats["lock"]:
                n = sum(v for k, v in stats.items() if k != "lock")
            print(f"  t={time.time() - t0:5.0f}s  rss={s[1]:.1f} MB  kv used {s[2]:.0f}/{s[3]:.0f}  "
                  f"requests {n}  failures {failures.total()}", flush=True)
    load_end = time.time() - t0
    time.sleep(args.sample_every)
    stop_sampling.set()
    threads[0].join()

    # 3. Everything returned once the load stopped.
    m, settle = {}, time.time() + 30
    while time.time() < settle:
        m = server.metrics()
        if m.get("iris_kv_cache_blocks_used") == 0 and m.get("iris_num_requests_running") == 0 \
                and m.get("iris_num_requests_waiting") == 0:
            break
        time.sleep(0.5)
    drained = m.get("iris_kv_cache_blocks_used") == 0 and m.get("iris_num_requests_running") == 0 \
        and m.get("iris_num_requests_waiting") == 0
    preemptions = m.get("iris_num_preemptions_total")

    # 4. Clean shutdown.
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = "killed after 60 s"

    # 2. Memory.
    w = args.warmup
    first = [s for s in samples if w <= s[0] < w + 60]
    last = [s for s in samples if load_end - 60 <= s[0] <= load_end]
    post = [s for s in samples if s[0] >= w and s[0] <= load_end]
    first_max, last_max = max(s[1] for s in first), max(s[1] for s in last)
    n = len(post)
    mt, mr = sum(s[0] for s in post) / n, sum(s[1] for s in post) / n
    slope = sum((s[0] - mt) * (s[1] - mr) for s in post) / max(sum((s[0] - mt) ** 2 for s in post), 1e-9) * 60
    warm = [s for s in samples if s[0] < w]
    kv_peak_warm = max((s[2] for s in warm if s[2] is not None), default=None)
    kv_total = next((s[3] for s in samples if s[3] is not None), None)
    mem_ok = last_max <= first_max + args.bound_mb

    with stats["lock"]:
        counts = {k: v for k, v in stats.items() if k != "lock"}
    print()
    print(f"load: {args.clients} clients for {load_end:.0f} s, {sum(counts.values())} requests: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"RSS (MB): first sample {samples[0][1]:.1f}, end of warm-up ({w:.0f} s) "
          f"{warm[-1][1] if warm else float('nan'):.1f}, min {min(s[1] for s in samples):.1f}, "
          f"max {max(s[1] for s in samples):.1f}, final {samples[-1][1]:.1f}; {len(samples)} samples every "
          f"{args.sample_every:g} s")
    print(f"RSS rule: last-minute max {last_max:.1f} <= first-minute-after-warm-up max {first_max:.1f} + "
          f"{args.bound_mb:g} -> {'ok' if mem_ok else 'FAILED'} (growth {last_max - first_max:+.1f} MB; "
          f"least-squares slope after warm-up {slope:+.2f} MB/min)")
    print(f"KV blocks: peak {kv_peak_warm:.0f} of {kv_total:.0f} in use during warm-up; "
          f"after the load: {'all free, nothing running or waiting' if drained else 'NOT DRAINED: ' + str(m)}; "
          f"preemptions {preemptions}")
    print(f"server exit status after SIGTERM: {code}")
    nfail = failures.total()
    print(f"failed requests: {nfail}")
    for k, v in sorted(failures.counts.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {v} x {k}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items()}, "samples": samples, "counts": counts,
            "failures": failures.counts, "rss_first_minute_max": first_max, "rss_last_minute_max": last_max,
            "slope_mb_per_min": slope, "drained": drained, "exit": code}, indent=1))
    ok = nfail == 0 and mem_ok and drained and code == 0
    print("SOAK " + ("PASSED" if ok else "FAILED"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
