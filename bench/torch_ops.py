"""The same ops as bench_ops.c in PyTorch; prints "BENCH <name> <ms per iteration>"."""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)


def time_it(name, fn):
    fn()
    iters = 0
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < 20:
        fn()
        iters += 1
    iters = max(1, iters * 10)
    best = 1e30
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) * 1e3 / iters)
    print(f"BENCH {name} {best:.5f}", flush=True)


def matmul(n, k, m):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(n, k, generator=g), torch.randn(k, m, generator=g)
    time_it(f"matmul_{n}x{k}x{m}", lambda: torch.matmul(a, b))


def cross_entropy(n, c):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, c, generator=g, requires_grad=True)
    y = torch.randint(0, c, (n,), generator=g)

    def step():
        x.grad = None
        F.cross_entropy(x, y).backward()

    time_it(f"cross_entropy_fwd_bwd_{n}x{c}", step)


def add_layer_norm(rows, cols):
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
    w, b = 1 + 0.1 * torch.randn(cols, generator=g), 0.1 * torch.randn(cols, generator=g)

    def step():
        s = x + r
        return s, F.layer_norm(s, (cols,), w, b)

    time_it(f"add_layer_norm_{rows}x{cols}", step)


if __name__ == "__main__":
    for s in [(64, 784, 256), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024)]:
        matmul(*s)
    for s in [(64, 10), (1024, 1000), (256, 50257)]:
        cross_entropy(*s)
    for s in [(2048, 768), (8192, 768)]:
        add_layer_norm(*s)
