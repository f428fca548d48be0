#!/usr/bin/env python3
"""The PyTorch side of bench_resnet: torchvision's resnet18 with the CIFAR stem (conv1 3x3
stride 1, no maxpool; the same network as Tandem's small_input ResNet), trained with SGD
(lr 0.05, momentum 0.9) on a fixed random batch, timed per step.

usage: $VENV/bin/python bench/torch_resnet.py [--steps 5] [--warmup 2] [--batch 32] [--hw 32]
                                              [--threads 1] [--depth 18]

Step time = zero_grad + forward + cross-entropy + backward + SGD step + loss.item(), the
batch prepared before timing. Prints one line per step, "torch step <ms>", then
"torch median <ms>", which bench_resnet reads back.
"""
import argparse
import os
import statistics
import time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--hw", type=int, default=32)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--depth", type=int, default=18)
args = ap.parse_args()
os.environ["OMP_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402 (after OMP_NUM_THREADS)
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

torch.set_num_threads(args.threads)
torch.manual_seed(0)
m = getattr(torchvision.models, "resnet%d" % args.depth)(num_classes=10)
m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
m.maxpool = torch.nn.Identity()
m.train()
opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
x = torch.randn(args.batch, 3, args.hw, args.hw)
y = torch.randint(0, 10, (args.batch,))

times = []
for s in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    loss.item()
    ms = (time.perf_counter() - t0) * 1e3
    if s >= args.warmup:
        times.append(ms)
        print("torch step %.2f" % ms)
print("torch median %.2f" % statistics.median(times))
