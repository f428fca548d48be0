#!/usr/bin/env python3
"""`tandem train` against PyTorch on the same Fashion-MNIST runs, in one invocation.

usage: python3 bench/bench_train.py [--tandem build/tandem] [--only mlp|cnn] [--limit N]
                                    [--epochs-mlp 3] [--epochs-cnn 2] [--no-torch]
                                    [--rounds-mlp 3] [--rounds-cnn 1]

Runs (batch 64 everywhere):
  mlp  SGD lr 0.01 momentum 0.9, 3 epochs
  cnn  Adam lr 1e-3, 2 epochs
each as
  tandem-1d    `tandem train` on one device (cpu:0), OPENBLAS_NUM_THREADS=1, 2 loader workers
  tandem-2d    the same on two devices (--devices cpu:0,cpu:1): data parallel, one core each
  tandem-1dall one device with nothing set: its matrix products on every core (OpenMP's
               default), what `--devices cpu:0` gives a user
  torch-1t     bench/torch_fmnist.py, 1 torch thread, OpenBLAS 1 thread
  torch-2t     bench/torch_fmnist.py, 2 torch threads, OpenBLAS 1 thread
and prints every epoch's training time and accuracy, then a summary with the ratio of
PyTorch's mean epoch time to Tandem's (> 1: Tandem is faster), and two devices' gain over
each one-device run. With several rounds (each
runs them all in turn, so a slow spell of a shared machine lands on all of them) a run's
time is the median of its rounds' means. Epoch times are the training
steps only (no evaluation) in both. PyTorch indexes a preloaded tensor (no DataLoader);
Tandem's DataLoader workers build batches on the side and their wait is reported.
PyTorch runs use the python given by --python (this one by default): the PyPI release in the
venv of scripts/setup --bench.
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
ap.add_argument("--only", choices=["mlp", "cnn"])
ap.add_argument("--limit", type=int, default=0, help="first N samples (quick check)")
ap.add_argument("--epochs-mlp", type=int, default=3)
ap.add_argument("--epochs-cnn", type=int, default=2)
ap.add_argument("--no-torch", action="store_true")
ap.add_argument("--rounds-mlp", type=int, default=3)
ap.add_argument("--rounds-cnn", type=int, default=1)
args = ap.parse_args()

CONFIGS = [
    dict(model="mlp", optimizer="sgd", lr=0.01, momentum=0.9, epochs=args.epochs_mlp,
         rounds=args.rounds_mlp),
    dict(model="cnn", optimizer="adam", lr=1e-3, momentum=None, epochs=args.epochs_cnn,
         rounds=args.rounds_cnn),
]


def run_tandem(c, devices, one_thread=True):
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "log.jsonl")
        cmd = [args.tandem, "train", "--model", c["model"], "--optimizer", c["optimizer"],
               "--lr", str(c["lr"]), "--epochs", str(c["epochs"]), "--batch-size", "64",
               "--log", log, "--quiet", "--devices", devices]
        if c["momentum"] is not None:
            cmd += ["--momentum", str(c["momentum"])]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        if not one_thread:
            del env["OPENBLAS_NUM_THREADS"], env["OMP_NUM_THREADS"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"tandem failed ({p.returncode}): {p.stderr.strip()}")
        epochs = [json.loads(line) for line in open(log) if '"type":"epoch"' in line]
    name = f"tandem-{len(devices.split(','))}d" + ("" if one_thread else "all")
    for e in epochs:
        print(f"  {name} {c['model']} epoch {e['epoch']}: {e['seconds']:.2f} s  "
              f"{e['img_s']:.0f} img/s  train loss {e['train_loss']:.4f}  "
              f"test acc {e['test_acc']:.4f}  loader wait {e['loader_wait_s']:.2f} s", flush=True)
    return epochs


def run_torch(c, threads):
    cmd = [args.python, os.path.join(HERE, "torch_fmnist.py"), "--model", c["model"],
           "--optimizer", c["optimizer"], "--lr", str(c["lr"]), "--epochs", str(c["epochs"]),
           "--batch", "64", "--threads", str(threads), "--blas-threads", "1"]
    if c["momentum"] is not None:
        cmd += ["--momentum", str(c["momentum"])]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"torch failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    res = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    for e in res["epochs"]:
        print(f"  torch-{threads}t {c['model']} epoch {e['epoch']}: {e['seconds']:.2f} s  "
              f"{e['img_s']:.0f} img/s  train loss {e['train_loss']:.4f}  "
              f"test acc {e['test_acc']:.4f}", flush=True)
    return res["epochs"]


def mean_time(epochs):
    return statistics.mean(e["seconds"] for e in epochs)


rows = []
for c in CONFIGS:
    if args.only and c["model"] != args.only:
        continue
    desc = f"{c['model']}: {c['optimizer']} lr {c['lr']}" + (
        f" momentum {c['momentum']}" if c["momentum"] is not None else "") + \
        f", batch 64, {c['epochs']} epochs, {c['rounds']} round(s)"
    print(desc, flush=True)
    runs = {}
    for _ in range(c["rounds"]):
        ran = {"tandem-1d": run_tandem(c, "cpu:0"), "tandem-2d": run_tandem(c, "cpu:0,cpu:1"),
               "tandem-1dall": run_tandem(c, "cpu:0", one_thread=False)}
        if not args.no_torch:
            ran["torch-1t"] = run_torch(c, 1)
            ran["torch-2t"] = run_torch(c, 2)
        for name, ep in ran.items():
            runs.setdefault(name, []).append(ep)
    for name, rounds in runs.items():
        rows.append((c["model"], name, statistics.median(mean_time(ep) for ep in rounds),
                     min(e["seconds"] for ep in rounds for e in ep), rounds[-1][-1]["test_acc"]))

print("\nsummary (epoch seconds, training steps only: mean (the median of the rounds' means) "
      "and best; speedup = the fastest PyTorch run's mean / this run's mean)")
print(f"{'model':5} {'run':12} {'mean s':>7} {'best s':>7} {'test acc':>8} {'speedup':>7}")
for model in dict.fromkeys(r[0] for r in rows):
    torch_means = [r[2] for r in rows if r[0] == model and r[1].startswith("torch")]
    ref = min(torch_means) if torch_means else float("nan")
    for m, name, mean, best, acc in rows:
        if m == model:
            print(f"{m:5} {name:12} {mean:7.2f} {best:7.2f} {acc:8.4f} {ref / mean:7.2f}")
    mean = {r[1]: r[2] for r in rows if r[0] == model}
    print(f"{model:5} two devices over one: {mean['tandem-1d'] / mean['tandem-2d']:.2f}x one "
          f"device on one core, {mean['tandem-1dall'] / mean['tandem-2d']:.2f}x one device "
          "with every core")
