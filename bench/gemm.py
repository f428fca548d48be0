"""GEMM at the shapes Tandem's models run, one core: Tandem's (build/bench_gemm) beside
OpenBLAS as it detects this CPU, OpenBLAS with its SkylakeX kernels forced, BLIS and MKL
inside PyTorch, in interleaved rounds (C libraries, then PyTorch, three times); prints a
Markdown table of the medians and Tandem's share of the fastest other library per shape.

    $VENV/bin/python bench/gemm.py build/bench_gemm

Given build/bench_gemm_bf16 instead, the same in bf16 (issue 37): Tandem's bf16 GEMM (fp32 and
bf16 results) and its fp32 one beside PyTorch's torch.mm on bf16 tensors (oneDNN or MKL inside
PyTorch), the share taken against PyTorch's bf16.
"""
import os
import re
import statistics
import subprocess
import sys
import time

import torch

lib = "/usr/lib/x86_64-linux-gnu/"
others = [f"OpenBLAS={lib}libopenblas.so.0",
          f"OpenBLAS-SkylakeX={lib}libopenblas.so.0@OPENBLAS_CORETYPE=SkylakeX",
          f"BLIS={lib}libblis.so.4"]
others = [o for o in others if os.path.exists(o.split("=")[1].split("@")[0])]
bf16 = "bf16" in os.path.basename(sys.argv[1])
if bf16:  # the BLAS libraries have no bf16 GEMM
    others = []
torch_dtype, torch_name = ((torch.bfloat16, "PyTorch bf16") if bf16 else
                           (torch.float32, "MKL (PyTorch)"))
env = dict(os.environ, OPENBLAS_NUM_THREADS="1", BLIS_NUM_THREADS="1", OMP_NUM_THREADS="1")
torch.set_num_threads(1)


def torch_gflops(m, n, k, ta, tb):
    a = torch.rand(k, m, dtype=torch_dtype) if ta else torch.rand(m, k, dtype=torch_dtype)
    b = torch.rand(n, k, dtype=torch_dtype) if tb else torch.rand(k, n, dtype=torch_dtype)
    a, b = (a.t() if ta else a), (b.t() if tb else b)
    c = torch.empty(m, n, dtype=torch_dtype)
    torch.mm(a, b, out=c), torch.mm(a, b, out=c)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        torch.mm(a, b, out=c)
        reps += 1
    return 2.0 * m * n * k * reps / (time.perf_counter() - t0) / 1e9


results, header = {}, ""  # (shape, dims) -> lib -> [GFLOP/s per round]
for rnd in range(3):
    out = subprocess.run([sys.argv[1], "--rounds", "1", *others], env=env, check=True,
                         capture_output=True, text=True).stdout
    shapes = []
    for line in out.splitlines():
        if line.startswith("# "):
            header = line[2:]
        f = line.split()
        if len(f) == 5 and f[0] == "GEMM":
            results.setdefault((f[2], f[3]), {}).setdefault(f[1], []).append(float(f[4]))
            if (f[2], f[3]) not in shapes:
                shapes.append((f[2], f[3]))
    for name, dims in shapes:
        m, n, k, ta, tb = re.match(r"(\d+)x(\d+)x(\d+)\((.)(.)\)", dims).groups()
        results[(name, dims)].setdefault(torch_name, []).append(
            torch_gflops(int(m), int(n), int(k), ta == "T", tb == "T"))

libs = list(next(iter(results.values())).keys())
print(f"{header.replace('median of 1 rounds', 'median of 3 interleaved rounds')}; "
      f"PyTorch {torch.__version__}; GFLOP/s")
print()
print("| shape (m x n x k) | " + " | ".join(libs) + " | Tandem / fastest other |")
print("|---" * (len(libs) + 2) + "|")
shares = []
for (name, dims), per in results.items():
    med = {l: statistics.median(v) for l, v in per.items()}
    best = max(v for l, v in med.items() if not l.startswith("Tandem"))
    shares.append(med["Tandem"] / best)
    print(f"| {name} {dims} | " + " | ".join(f"{med[l]:.0f}" for l in libs) +
          f" | {med['Tandem'] / best:.0%} |")
print()
print(f"Tandem's share of the fastest other library: lowest {min(shares):.0%}, "
      f"median {statistics.median(shares):.0%}")
