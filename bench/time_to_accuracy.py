#!/usr/bin/env python3
"""Time to accuracy on Fashion-MNIST (issue 20): `tandem train --recipe fmnist-fast` against
the same recipe in PyTorch (bench/torch_recipe.py), whole processes from a cold start, seeds
interleaved (PyTorch then Tandem for each seed, so both see the same machine), then the
stretch: the same recipe with as many epochs as fit in 60 s and in 5 minutes on each side.

usage: $VENV/bin/python bench/time_to_accuracy.py [--seeds 5] [--out DIR] [--tandem PATH]
           [--no-stretch] [--target 0.92]

Prints a markdown table for bench/RESULTS.md: per side and seed the whole process's wall
time, the test accuracy after each epoch, the accuracy known 30 s after the start, and the
seconds to the target (wall_s of the first
epoch at or above it, from each run's --log); then mean and worst accuracy, median times and
Tandem's speed-up. Tandem's run of the first seed draws --plot DIR/fmnist-fast.svg with
PyTorch's run of that seed (--plot-compare).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ap = argparse.ArgumentParser()
ap.add_argument("--seeds", type=int, default=5)
ap.add_argument("--out", default="/tmp/tta")
ap.add_argument("--tandem", default=os.path.join(ROOT, "build", "tandem"))
ap.add_argument("--target", type=float, default=0.92)
ap.add_argument("--no-stretch", action="store_true")
args = ap.parse_args()
os.makedirs(args.out, exist_ok=True)


def epochs_of(log):
    with open(log) as f:
        return [e for e in map(json.loads, f) if e.get("type") == "epoch"]


def run(side, seed, epochs=None, plot=False):
    """One whole process; returns (wall seconds, [(wall_s, test_acc) per epoch])."""
    log = os.path.join(args.out, f"{side}-{seed}{'-e%d' % epochs if epochs else ''}.jsonl")
    if side == "tandem":
        cmd = [args.tandem, "train", "--recipe", "fmnist-fast", "--seed", str(seed), "--quiet",
               "--log", log]
        if epochs:
            cmd += ["--epochs", str(epochs)]
        if plot:
            torch_log = os.path.join(args.out, f"torch-{seed}.jsonl")
            cmd += ["--plot", os.path.join(args.out, "fmnist-fast.svg"),
                    "--plot-compare", f"{torch_log}=PyTorch"]
    else:
        cmd = [sys.executable, os.path.join(HERE, "torch_recipe.py"), "--seed", str(seed),
               "--log", log]
        if epochs:
            cmd += ["--epochs", str(epochs)]
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.time() - t0
    return wall, [(e["wall_s"], e["test_acc"]) for e in epochs_of(log)]


def to_target(curve):
    return next((w for w, a in curve if a >= args.target), None)


def acc_at(curve, seconds):
    """The last test accuracy known within `seconds` of the start, or None."""
    known = [a for w, a in curve if w <= seconds]
    return known[-1] if known else None


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


results = {"torch": [], "tandem": []}
for seed in range(1, args.seeds + 1):
    for side in ("torch", "tandem"):
        wall, curve = run(side, seed, plot=(side == "tandem" and seed == 1))
        results[side].append((seed, wall, curve))
        print(f"# {side} seed {seed}: {wall:.1f} s, acc "
              + " ".join(f"{100 * a:.2f}" for _, a in curve), file=sys.stderr, flush=True)

print(f"| side | seed | process s | test acc per epoch (%) | s to {100 * args.target:.0f}% "
      "| acc at 30 s (%) |")
print("|---|---|---|---|---|---|")
for side in ("tandem", "torch"):
    for seed, wall, curve in results[side]:
        accs = " ".join(f"{100 * a:.2f}" for _, a in curve)
        at30 = acc_at(curve, 30)
        print(f"| {side} | {seed} | {wall:.1f} | {accs} | {fmt(to_target(curve))} "
              f"| {fmt(None if at30 is None else 100 * at30, '.2f')} |")
print()
summary = {}
for side in ("tandem", "torch"):
    finals = [c[-1][1] for _, _, c in results[side]]
    walls = [w for _, w, _ in results[side]]
    reach = [to_target(c) for _, _, c in results[side]]
    summary[side] = (statistics.median(walls), [r for r in reach if r is not None])
    print(f"- {side}: final test accuracy mean {100 * statistics.mean(finals):.2f}%, worst "
          f"{100 * min(finals):.2f}%; process median {statistics.median(walls):.1f} s "
          f"(max {max(walls):.1f}); reached {100 * args.target:.0f}% in "
          f"{len(summary[side][1])}/{len(reach)} runs")
speedup = summary["torch"][0] / summary["tandem"][0]
print(f"- Tandem {speedup:.2f}x faster (median whole-process time, same recipe and epochs)")

if not args.no_stretch:
    print()
    print("| budget | side | epochs | process s | final test acc |")
    print("|---|---|---|---|---|")
    for budget in (60, 300):
        for side in ("tandem", "torch"):
            seed, wall, curve = results[side][0]
            per_epoch = (wall - 1.0) / len(curve)  # about 1 s of start-up on either side
            epochs = max(1, int((budget - 1.5) / per_epoch))
            wall, curve = run(side, 1, epochs=epochs)
            print(f"| {budget} s | {side} | {epochs} | {wall:.1f} | {100 * curve[-1][1]:.2f}% |",
                  flush=True)
