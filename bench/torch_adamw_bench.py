#!/usr/bin/env python3
"""torch.optim.AdamW(fused=True) against flatshard's fused AdamW kernel, side by side.

Reads the JSON that `kernels_cuda_bench --json=PATH` wrote in the same run, times
PyTorch's fused AdamW on the same sizes (one flat fp32 parameter, its gradient, the
same hyper-parameters; CUDA events, median of 20 steps after 3 warm-ups, random data)
and prints the ratio torch time / flatshard time (above 1.0: flatshard is faster).

    python3 bench/torch_adamw_bench.py results.json
"""
import json
import statistics
import sys

import torch


def time_torch_adamw(numel):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, device="cuda"))
    param.grad = torch.randn(numel, device="cuda")
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: torch_adamw_bench.py RESULTS_JSON")
    with open(sys.argv[1]) as f:
        results = json.load(f)
    if not torch.cuda.is_available():
        sys.exit("torch_adamw_bench: torch sees no CUDA device")
    copy_gbps = results["copy_gbps"]
    print(f"\nfused AdamW: flatshard vs torch {torch.__version__} "
          f"(AdamW(fused=True)) on {torch.cuda.get_device_name()}")
    print("| params | flatshard (ms) | torch fused (ms) | torch / flatshard "
          "| flatshard vs copy bound | torch vs copy bound |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in results["rows"]:
        if row["kernel"] != "AdamW (fused)":
            continue
        numel = row["numel"]
        ours = row["ms"]
        theirs = time_torch_adamw(numel)
        bound_ms = 28 * numel / (copy_gbps * 1e9) * 1e3
        print(f"| {numel >> 20}M | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f}x "
              f"| {bound_ms / ours:.2f}x | {bound_ms / theirs:.2f}x |")


if __name__ == "__main__":
    main()
