#!/usr/bin/env python3
"""PyTorch's optimizer step speed on one thread, for comparison with bench/bench_optim.c.

    $VENV/bin/python bench/torch_optim.py [path/to/bench_optim]

Times Adam, AdamW and SGD(momentum=0.9) steps over one 1M and one 10M-element parameter with
foreach=False (the single-tensor loop) and foreach=True (multi-tensor kernels); the median of
the timed steps, in ms. Given the path of the C benchmark, runs it too and prints the ratios
torch / tandem (above 1: tandem is faster).
"""
import statistics
import subprocess
import sys
import time

import torch

torch.set_num_threads(1)


def time_steps(opt, reps):
    for _ in range(3):
        opt.step()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


results = {}
for n in (1_000_000, 10_000_000):
    torch.manual_seed(42)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    reps = 15 if n > 5_000_000 else 41
    for foreach in (False, True):
        for name, make in (
            ("adam", lambda: torch.optim.Adam([p], foreach=foreach)),
            ("adamw", lambda: torch.optim.AdamW([p], foreach=foreach)),
            ("sgd_momentum", lambda: torch.optim.SGD([p], lr=0.01, momentum=0.9, foreach=foreach)),
        ):
            ms = time_steps(make(), reps)
            results[(name, n, foreach)] = ms
            print("torch%s %s %d %.3f" % ("_foreach" if foreach else "", name, n, ms), flush=True)

if len(sys.argv) > 1:
    out = subprocess.run([sys.argv[1]], capture_output=True, text=True, check=True).stdout
    print(out, end="")
    print("\n%-14s %9s %10s %10s %12s %8s %8s" % ("optimizer", "params", "tandem ms", "torch ms",
                                                 "foreach ms", "ratio", "ratio fe"))
    for line in out.splitlines():
        _, name, n, ms = line.split()
        n, ms = int(n), float(ms)
        t0, t1 = results[(name, n, False)], results[(name, n, True)]
        print("%-14s %9d %10.3f %10.3f %12.3f %8.2f %8.2f" % (name, n, ms, t0, t1, t0 / ms, t1 / ms))
