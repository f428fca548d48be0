#!/usr/bin/env python3
"""PyTorch reference for bench/bench_conv.c: conv2d forward+backward and max_pool2d on the
Fashion-MNIST CNN shapes, one thread. Run with the python of scripts/setup --bench's venv
(PyTorch from PyPI). Prints ms per iteration, one line per case, in the
format bench_conv reads back ("torch <case> <ms>")."""
import os
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
N = 64


def timeit(fn, min_time=1.0, warmup=5):
    for _ in range(warmup):
        fn()
    iters, t0 = 0, time.perf_counter()
    best = float("inf")
    while time.perf_counter() - t0 < min_time or iters < 10:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        iters += 1
    total = time.perf_counter() - t0
    return total / iters * 1e3, best * 1e3


def conv_case(cin, cout, hw, x_grad):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, cin, hw, hw, generator=g, requires_grad=x_grad)
    w = torch.randn(cout, cin, 3, 3, generator=g, requires_grad=True)
    b = torch.randn(cout, generator=g, requires_grad=True)
    gy = torch.randn(N, cout, hw, hw, generator=g)

    def fwd():
        with torch.no_grad():
            F.conv2d(x, w, b, padding=1)

    def fwdbwd():
        y = F.conv2d(x, w, b, padding=1)
        y.backward(gy)
        w.grad = None
        b.grad = None
        x.grad = None

    return fwd, fwdbwd


def pool_case(c, hw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, c, hw, hw, generator=g, requires_grad=True)
    gy = torch.randn(N, c, hw // 2, hw // 2, generator=g)

    def fwd():
        with torch.no_grad():
            F.max_pool2d(x, 2)

    def fwdbwd():
        y = F.max_pool2d(x, 2)
        y.backward(gy)
        x.grad = None

    return fwd, fwdbwd


def main():
    min_time = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}, "
          f"mkldnn {torch.backends.mkldnn.is_available()}")
    cases = [
        ("conv1_fwd", conv_case(1, 32, 28, False)[0]),
        ("conv1_fwdbwd", conv_case(1, 32, 28, False)[1]),
        ("conv2_fwd", conv_case(32, 64, 14, True)[0]),
        ("conv2_fwdbwd", conv_case(32, 64, 14, True)[1]),
        ("pool1_fwd", pool_case(32, 28)[0]),
        ("pool1_fwdbwd", pool_case(32, 28)[1]),
        ("pool2_fwd", pool_case(64, 14)[0]),
        ("pool2_fwdbwd", pool_case(64, 14)[1]),
    ]
    for name, fn in cases:
        mean, best = timeit(fn, min_time)
        print(f"torch {name} {mean:.4f} {best:.4f}")


if __name__ == "__main__":
    main()
