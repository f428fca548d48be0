#!/usr/bin/env python3
"""`tandem train --recipe fmnist-fast` written in PyTorch, for bench/time_to_accuracy.py: the
same network (cnn-bn: nn.Sequential with the same layers, so the same parameter names and
default initialisation), optimizer, schedule, augmentation, batch and evaluation.

usage: $VENV/bin/python bench/torch_recipe.py [--epochs 4] [--seed S] [--threads 2]
           [--log FILE.jsonl] [--validation N]

Written the way a PyTorch user after speed writes it: the dataset held as one tensor (no
DataLoader), each epoch a seeded randperm, the flips drawn per sample for the whole batch at
once, the last partial batch kept (as Tandem's loader does). Each epoch is evaluated on the
test set (or the held-out --validation samples) with flip averaging. --log writes Tandem's
--log epoch lines ("type", "epoch", "test_acc", "test_loss", "seconds", "wall_s"), wall_s
counted from the start of this script (before `import torch`), so `tandem train --plot
--plot-compare` draws both runs on one chart. The last line printed is "RESULT {json}".
"""
import time

T0 = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--epochs", type=int, default=4)
ap.add_argument("--batch", type=int, default=256)
ap.add_argument("--lr", type=float, default=0.2)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--validation", type=int, default=0,
                help="hold out N evenly spaced training samples as the test set")
ap.add_argument("--log", default=None)
args = ap.parse_args()
os.environ["OMP_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fmnist_common import load  # noqa: E402

torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)

MEAN, STD = 0.2860, 0.3530  # Normalize(fmnist)


def split(xtr, ytr, n_val):
    """Tandem's --validation: samples k * n / n_val held out, the rest trained on in order."""
    n = len(xtr)
    held = torch.zeros(n, dtype=torch.bool)
    held[torch.tensor([k * n // n_val for k in range(n_val)])] = True
    return xtr[~held], ytr[~held], xtr[held], ytr[held]


def cnn_bn():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(32),
        nn.ReLU(), nn.Flatten(), nn.Linear(32 * 7 * 7, 256), nn.ReLU(), nn.Linear(256, 10))


xtr, ytr = load("train")
xte, yte = load("t10k")
if args.validation:
    xtr, ytr, xte, yte = split(xtr, ytr, args.validation)
xtr, xte = (xtr - MEAN) / STD, (xte - MEAN) / STD
model = cnn_bn()
decay = [p for p in model.parameters() if p.ndim >= 2]
no_decay = [p for p in model.parameters() if p.ndim < 2]
opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                       {"params": no_decay, "weight_decay": 0.0}],
                      lr=args.lr, momentum=0.9, nesterov=True)
n = len(xtr)
steps = (n + args.batch - 1) // args.batch
sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.epochs * steps,
                                            pct_start=0.25, cycle_momentum=False)


def evaluate():
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(xte), 1000):
            x, y = xte[i:i + 1000], yte[i:i + 1000]
            out = (model(x) + model(x.flip(3))) * 0.5
            loss_sum += F.cross_entropy(out, y, label_smoothing=0.1, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
    model.train()
    return correct / len(xte), loss_sum / len(xte)


log = open(args.log, "w") if args.log else None
for epoch in range(1, args.epochs + 1):
    t_epoch = time.time()
    perm = torch.randperm(n)
    for i in range(0, n, args.batch):
        idx = perm[i:i + args.batch]
        x, y = xtr[idx], ytr[idx]
        flip = torch.rand(len(idx)) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x)
        loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    seconds = time.time() - t_epoch
    acc, test_loss = evaluate()
    wall = time.time() - T0
    line = {"type": "epoch", "epoch": epoch, "test_acc": acc, "test_loss": test_loss,
            "seconds": seconds, "wall_s": wall}
    print(f"epoch {epoch}/{args.epochs}  test acc {100 * acc:.2f}%  {seconds:.2f} s  "
          f"wall {wall:.2f} s", flush=True)
    if log:
        log.write(json.dumps(line) + "\n")
        log.flush()
print("RESULT " + json.dumps({"test_acc": acc, "wall_s": time.time() - T0, "torch":
                              torch.__version__, "threads": args.threads, "seed": args.seed}))
