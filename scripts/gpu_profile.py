#!/usr/bin/env python3
"""Per-kernel GPU time of iris steps from an Nsight Compute CSV (scripts/gpu-profile.sh).

    gpu_profile.py NCU.csv STEPS [SKIP]

Takes the span of the last STEPS steps before the last SKIP steps (a step = one launch of the
paged-attention kernel per layer; the layer count is read off the model's config via
--layers), sums gpu__time_duration per kernel name over it and prints per-step times.
"""
import csv
import sys
from collections import defaultdict


def main():
    path, steps, skip, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rows = []
    with open(path) as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r["Metric Unit"]
        us = v / 1e3 if unit == "nsecond" else v * 1e3 if unit == "msecond" else v if unit == "usecond" else v / 1e3
        rows.append((r["Kernel Name"].split("(")[0][:60], us, r.get("Grid Size", "")))
    attn = [i for i, r in enumerate(rows) if r[0].startswith("paged_attention")]
    if len(attn) < (steps + skip) * layers:
        print(f"only {len(attn)} attention launches in {len(rows)} kernels")
        return
    start = attn[len(attn) - (steps + skip) * layers]
    end = attn[len(attn) - skip * layers] if skip else len(rows)
    per = defaultdict(lambda: [0.0, 0])
    for name, us, _ in rows[start:end]:
        per[name][0] += us / steps
        per[name][1] += 1
    total = sum(v[0] for v in per.values())
    print(f"{total:.0f} us of kernel time per step ({(end - start) // steps} launches per step)")
    print("| kernel | us/step | launches/step | share |")
    print("|---|---|---|---|")
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:18]:
        print(f"| {name} | {us:.0f} | {n // steps} | {100 * us / total:.0f}% |")


if __name__ == "__main__":
    main()
