#!/usr/bin/env python3
"""PyTorch's tensor parallelism on CPU, the other side of bench_tp's `tp` case: a byte-level
GPT-2 (12 layers, 768 channels, 12 heads, context 256 by default) split over 2 processes with
torch.distributed.tensor.parallel (ColwiseParallel for q, k, v and c_fc, RowwiseParallel for
the two projections, as torchtitan's plan; no sequence parallelism), gloo between the
processes, one thread each, AdamW, the same global batch of B sequences on every rank. Prints
the median step time (forward, backward, optimizer step, loss.item()) over the steps after
the first.

usage: $VENV/bin/python bench/torch_tp.py [--steps 6] [--batch 2] [--tp 2] [--layers 12]
                                          [--channels 768] [--heads 12] [--context 256]
"""
import argparse
import math
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=6)
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--tp", type=int, default=2)
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--channels", type=int, default=768)
ap.add_argument("--heads", type=int, default=12)
ap.add_argument("--context", type=int, default=256)
args = ap.parse_args()
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402  (after the thread settings)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,  # noqa: E402
                                               parallelize_module)

L, C, NH, T, B, V = args.layers, args.channels, args.heads, args.context, args.batch, 256


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.wq, self.wk, self.wv = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.c_proj = nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        Bn, Tn, _ = x.shape
        h = self.ln_1(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)  # each rank its heads' columns
        nh = q.shape[-1] // (C // NH)
        q, k, v = (t.view(Bn, Tn, nh, C // NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(Bn, Tn, -1))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, V), tgt.view(-1))


def rank_main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = GPT()
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
            "c_proj": RowwiseParallel(), "c_fc": ColwiseParallel(), "mlp_proj": RowwiseParallel()}
    for b in model.h:
        parallelize_module(b, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(1)
    ms = []
    for _ in range(args.steps):
        x = torch.randint(0, V, (B, T), generator=g)
        t0 = time.perf_counter()
        loss = model(x, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        ms.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        rest = sorted(ms[1:])
        print("torch %s tp %d (gloo, 1 thread a process): GPT L%d C%d H%d T%d, batch %d: median "
              "%.0f ms/step over %d steps (the first not counted)"
              % (torch.__version__, world, L, C, NH, T, B, rest[len(rest) // 2], len(rest)))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(args.tp,), nprocs=args.tp)
