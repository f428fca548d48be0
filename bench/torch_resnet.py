#!/usr/bin/env python3
"""The PyTorch side of bench_resnet: torchvision's resnet18 (the ImageNet stem, or with
--stem cifar the CIFAR stem: conv1 3x3 stride 1, no maxpool; the same networks as Tandem's
ResNets), trained with SGD (lr 0.05, momentum 0.9) on a fixed random batch, timed per step.

usage: $VENV/bin/python bench/torch_resnet.py [--steps 5] [--warmup 2] [--batch 32] [--hw 32]
            [--classes 10] [--stem imagenet|cifar] [--threads 1] [--depth 18] [--channels-last]
            [--serve] [--autocast none|bf16]

Step time = zero_grad + forward + cross-entropy + backward + SGD step + loss.item(), the
batch prepared before timing. Prints one line per step, "torch step <ms>", then
"torch median <ms>", which bench_resnet reads back.

--serve keeps the process (and both memory formats' models, warmed up) alive for
bench_resnet's interleaved rounds: it reads lines "run nchw|cl <steps>" on stdin and answers
each with its steps and median, so a round costs no interpreter start and no first-step
allocations. "quit" or end of input ends it.
"""
import argparse
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--hw", type=int, default=32)
ap.add_argument("--classes", type=int, default=10)
ap.add_argument("--stem", choices=["imagenet", "cifar"])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--depth", type=int, default=18)
ap.add_argument("--channels-last", action="store_true")
ap.add_argument("--serve", action="store_true")
ap.add_argument("--autocast", choices=["none", "bf16"], default="none",
                help="forward and loss under torch.autocast('cpu', dtype=torch.bfloat16)")
args = ap.parse_args()
if args.stem is None:  # the old command line: the CIFAR stem at 32x32
    args.stem = "cifar" if args.hw <= 64 else "imagenet"
os.environ["OMP_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402 (after OMP_NUM_THREADS)
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

torch.set_num_threads(args.threads)


def make(channels_last):
    torch.manual_seed(0)
    m = getattr(torchvision.models, "resnet%d" % args.depth)(num_classes=args.classes)
    if args.stem == "cifar":
        m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        m.maxpool = torch.nn.Identity()
    m.train()
    x = torch.randn(args.batch, 3, args.hw, args.hw)
    y = torch.randint(0, args.classes, (args.batch,))
    if channels_last:
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return m, opt, x, y


def step(case):
    m, opt, x, y = case
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
        loss = F.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    loss.item()
    return (time.perf_counter() - t0) * 1e3


def run(case, warmup, steps):
    times = []
    for s in range(warmup + steps):
        ms = step(case)
        if s >= warmup:
            times.append(ms)
            print("torch step %.2f" % ms)
    print("torch median %.2f" % statistics.median(times), flush=True)


if not args.serve:
    run(make(args.channels_last), args.warmup, args.steps)
    sys.exit(0)

cases = {"nchw": make(False), "cl": make(True)}
for c in cases.values():  # first-step allocations and oneDNN's JIT, before any timing
    for _ in range(args.warmup):
        step(c)
print("torch ready %s %s" % (torch.__version__, torch.backends.mkldnn.is_available()), flush=True)
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "quit":
        break
    if words[0] == "run" and len(words) == 3 and words[1] in cases:
        run(cases[words[1]], 0, int(words[2]))
    else:
        print("torch error %s" % line.strip(), flush=True)
