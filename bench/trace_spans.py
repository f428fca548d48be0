#!/usr/bin/env python3
"""Mean time of each span of a `tandem train --trace` file, per track (thread).

usage: python3 bench/trace_spans.py TRACE.json [--steps N]

Prints, for every (track, span name) seen at least --min times, the count, the mean span in
microseconds and the total divided by --steps (default: the count of the busiest span), which
for per-step spans is their cost per training step. Nested spans are counted in their parents
too.
"""
import argparse
import collections
import json

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("trace")
ap.add_argument("--steps", type=int, default=0)
ap.add_argument("--min", type=int, default=100, help="leave out spans seen fewer times (100)")
args = ap.parse_args()

data = json.load(open(args.trace))
events = data["traceEvents"] if isinstance(data, dict) else data
names = {e["tid"]: e["args"]["name"] for e in events
         if e.get("ph") == "M" and e.get("name") == "thread_name"}
open_spans = collections.defaultdict(list)
spans = collections.defaultdict(list)  # (track, name) -> durations in us
for e in events:
    track = names.get(e.get("tid"), str(e.get("tid")))
    if e.get("ph") == "B":
        open_spans[e["tid"]].append(e)
    elif e.get("ph") == "E" and open_spans[e["tid"]]:
        b = open_spans[e["tid"]].pop()
        spans[(track, b["name"])].append(e["ts"] - b["ts"])
    elif e.get("ph") == "X":
        spans[(track, e["name"])].append(e.get("dur", 0))
steps = args.steps or max(len(v) for v in spans.values())
print(f"{'track':40} {'span':36} {'count':>6} {'mean us':>9} {'us/step':>9}")
for (track, name), d in sorted(spans.items()):
    if len(d) >= args.min:
        print(f"{track[:40]:40} {name[:36]:36} {len(d):6d} {sum(d) / len(d):9.1f} "
              f"{sum(d) / steps:9.1f}")
