#!/usr/bin/env python3
"""PyTorch reference runs for `tandem train` on Fashion-MNIST: the same models (nn.Sequential,
so the same parameter names and default initialisation), optimizers and batch size.

usage: $VENV/bin/python bench/torch_fmnist.py --model mlp|cnn [--epochs N] [--batch 64]
           [--optimizer sgd|adam|adamw] [--lr LR] [--momentum M] [--threads T]
           [--blas-threads T] [--seed S] [--limit N] [--autocast none|bf16]

Data: the whole training set held as one tensor; each epoch a seeded randperm; batches are
index slices (no DataLoader), the last partial batch included. Epoch time = the training loop
only; the test set is evaluated after each epoch (not timed). The last line printed is
"RESULT {json}" for scripts (bench/bench_train.py).
"""
import argparse
import json
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--model", choices=["mlp", "cnn"], required=True)
ap.add_argument("--epochs", type=int, default=3)
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default=None,
                help="default: sgd for mlp, adam for cnn")
ap.add_argument("--lr", type=float, default=None, help="default: 0.1 for sgd, 1e-3 otherwise")
ap.add_argument("--momentum", type=float, default=0.9)
ap.add_argument("--threads", type=int, default=1, help="torch intra-op (OpenMP) threads")
ap.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--limit", type=int, default=0, help="first N train and N/6 test samples")
ap.add_argument("--autocast", choices=["none", "bf16"], default="none",
                help="forward and loss under torch.autocast('cpu', dtype=torch.bfloat16)")
args = ap.parse_args()

# must happen before torch loads libgomp and libopenblas
os.environ["OMP_NUM_THREADS"] = str(args.threads)
os.environ["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fmnist_common import load, make_model  # noqa: E402

torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)
xtr, ytr = load("train")
xte, yte = load("t10k")
if args.limit:
    xtr, ytr = xtr[:args.limit], ytr[:args.limit]
    xte, yte = xte[:max(1, args.limit // 6)], yte[:max(1, args.limit // 6)]

optimizer = args.optimizer or ("sgd" if args.model == "mlp" else "adam")
lr = args.lr if args.lr is not None else (0.1 if optimizer == "sgd" else 1e-3)
model = make_model(args.model)
if optimizer == "sgd":
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
elif optimizer == "adam":
    opt = torch.optim.Adam(model.parameters(), lr=lr)
else:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


@torch.no_grad()
def evaluate():
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(xte), 1000):
        out = model(xte[i:i + 1000])
        loss += F.cross_entropy(out, yte[i:i + 1000], reduction="sum").item()
        correct += (out.argmax(1) == yte[i:i + 1000]).sum().item()
    model.train()
    return loss / len(xte), correct / len(xte)


g = torch.Generator().manual_seed(args.seed)
n = len(xtr)
epochs = []
for ep in range(args.epochs):
    perm = torch.randperm(n, generator=g)
    t0 = time.perf_counter()
    loss_sum, correct = 0.0, 0
    for i in range(0, n, args.batch):
        idx = perm[i:i + args.batch]
        xb, yb = xtr[idx], ytr[idx]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            out = model(xb)
            loss = F.cross_entropy(out, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.item() * len(idx)
        correct += (out.argmax(1) == yb).sum().item()
    dt = time.perf_counter() - t0
    test_loss, test_acc = evaluate()
    epochs.append(dict(epoch=ep + 1, seconds=dt, img_s=n / dt, train_loss=loss_sum / n,
                       train_acc=correct / n, test_loss=test_loss, test_acc=test_acc))
    print(f"torch {args.model} epoch {ep + 1}: {dt:.2f} s  {n / dt:.0f} img/s  "
          f"train loss {loss_sum / n:.4f}  test acc {test_acc:.4f}", flush=True)

print("RESULT " + json.dumps(dict(model=args.model, optimizer=optimizer, lr=lr, autocast=args.autocast,
                                  threads=args.threads, blas_threads=args.blas_threads,
                                  torch=torch.__version__, epochs=epochs)))
