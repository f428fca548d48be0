"""Joins "BENCH <name> <ms>" lines from Tandem and PyTorch into a Markdown table with the
ratio torch/tandem (above 1: Tandem is faster). Lines named sgemm_* (the raw GEMM call, cpu_gemm.c, on the
same buffers) are set beside the matching matmul_* as "vs GEMM".

    python3 bench/join.py TANDEM_OUTPUT TORCH_OUTPUT
"""
import sys


def read(path):
    out = {}
    for line in open(path):
        parts = line.split()
        if len(parts) == 3 and parts[0] == "BENCH":
            out[parts[1]] = float(parts[2])
    return out


tandem, torch = read(sys.argv[1]), read(sys.argv[2])
print("| op | Tandem ms | PyTorch ms | PyTorch / Tandem | its GEMM alone ms | Tandem / GEMM |")
print("|---|---|---|---|---|---|")
for name, ms in tandem.items():
    if name.startswith("sgemm_"):
        continue
    t = torch.get(name)
    blas = tandem.get(name.replace("matmul_", "sgemm_")) if name.startswith("matmul_") else None
    print(f"| {name} | {ms:.4f} | {t:.4f} | {t / ms:.2f} | " if t else f"| {name} | {ms:.4f} | - | - | ",
          end="")
    print(f"{blas:.4f} | {ms / blas:.3f} |" if blas else "- | - |")
