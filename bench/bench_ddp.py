#!/usr/bin/env python3
"""`mpirun -np N tandem train` against PyTorch DDP (gloo) on the same Fashion-MNIST runs.

usage: python3 bench/bench_ddp.py [--tandem build/tandem] [--world 2] [--only mlp|cnn]
                                  [--epochs 1] [--limit N] [--rounds 3]

Runs (global batch 64, so 32 per process with 2 processes; one thread per process):
  mlp  SGD lr 0.01 momentum 0.9      cnn  Adam lr 1e-3
each as
  tandem-mpi   mpirun -np N tandem train (MPI backend, DistributedSampler, DDP buckets)
  torch-ddp    bench/torch_ddp.py: N processes of torch.multiprocessing, gloo, DDP
and prints every epoch's training time and test accuracy, then the ratio of PyTorch's
mean epoch time to Tandem's (> 1: Tandem is faster): the median over --rounds rounds, each
Tandem then PyTorch, so that a slow spell of a shared machine lands on both sides. Needs Open MPI's mpirun and Debian's
PyTorch from the python given by --python (this one by default).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--tandem", default=os.path.join(ROOT, "build", "tandem"))
ap.add_argument("--python", default=sys.executable,
                help="a python with PyTorch (default: this one; bench/run uses the venv of scripts/setup --bench)")
ap.add_argument("--world", type=int, default=2)
ap.add_argument("--only", choices=["mlp", "cnn"])
ap.add_argument("--epochs", type=int, default=1)
ap.add_argument("--limit", type=int, default=0)
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()

CONFIGS = [dict(model="mlp", optimizer="sgd", lr=0.01, momentum=0.9),
           dict(model="cnn", optimizer="adam", lr=1e-3, momentum=None)]
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(cmd):
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return p.stdout


def run_tandem(c):
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "log.jsonl")
        cmd = ["mpirun", "-np", str(args.world), args.tandem, "train", "--model", c["model"],
               "--optimizer", c["optimizer"], "--lr", str(c["lr"]), "--epochs", str(args.epochs),
               "--batch-size", "64", "--log", log, "--quiet"]
        if c["momentum"] is not None:
            cmd += ["--momentum", str(c["momentum"])]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        run(cmd)
        epochs = [json.loads(line) for line in open(log) if '"type":"epoch"' in line]
    for e in epochs:
        print(f"  tandem-mpi {c['model']} epoch {e['epoch']}: {e['seconds']:.2f} s  "
              f"{e['img_s']:.0f} img/s  train loss {e['train_loss']:.4f}  "
              f"test acc {e['test_acc']:.4f}", flush=True)
    return epochs


def run_torch(c):
    cmd = [args.python, os.path.join(HERE, "torch_ddp.py"), "--model", c["model"], "--world",
           str(args.world), "--optimizer", c["optimizer"], "--lr", str(c["lr"]), "--epochs",
           str(args.epochs), "--batch", "64"]
    if c["momentum"] is not None:
        cmd += ["--momentum", str(c["momentum"])]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    out = run(cmd)
    epochs = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])["epochs"]
    for e in epochs:
        print(f"  torch-ddp  {c['model']} epoch {e['epoch']}: {e['seconds']:.2f} s  "
              f"{e['img_s']:.0f} img/s  train loss {e['train_loss']:.4f}  "
              f"test acc {e['test_acc']:.4f}", flush=True)
    return epochs


rows = []
for c in CONFIGS:
    if args.only and c["model"] != args.only:
        continue
    print(f"{c['model']}: {c['optimizer']} lr {c['lr']}, global batch 64, {args.world} processes "
          f"x 1 thread, {args.epochs} epoch(s), {args.rounds} round(s)", flush=True)
    rounds = []
    for _ in range(args.rounds):
        t, p = run_tandem(c), run_torch(c)
        rounds.append((statistics.mean(e["seconds"] for e in t), t[-1]["test_acc"],
                       statistics.mean(e["seconds"] for e in p), p[-1]["test_acc"]))
    ratio = statistics.median(ps / ts for ts, _, ps, _ in rounds)
    ts, ta, ps, pa = (statistics.median(r[i] for r in rounds) for i in range(4))
    rows.append((c["model"], ts, ta, ps, pa, ratio))

print("\nsummary (median over the rounds of the mean epoch seconds, training steps only;")
print("speedup = the median of the rounds' PyTorch DDP / Tandem)")
print(f"{'model':5} {'tandem s':>8} {'acc':>7} {'torch s':>8} {'acc':>7} {'speedup':>7}")
for m, ts, ta, ps, pa, ratio in rows:
    print(f"{m:5} {ts:8.2f} {ta:7.4f} {ps:8.2f} {pa:7.4f} {ratio:7.2f}")
