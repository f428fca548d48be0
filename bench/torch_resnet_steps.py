#!/usr/bin/env python3
"""The PyTorch side of bench_resnet_steps: torchvision's resnet18 with the CIFAR stem, its
weights and buffers from Tandem's safetensors file, trained with SGD (lr 0.05, momentum 0.9)
on the batches of the data file in turn; prints "torch loss <step> <loss>" per step.

usage: $VENV/bin/python bench/torch_resnet_steps.py --weights W --data D [--steps 20]
                                                    [--batch 128] [--threads 2]

The files are read here (8-byte header length, JSON header, raw little-endian data), so the
venv needs no safetensors package.
"""
import argparse
import json
import struct

import torch
import torch.nn.functional as F
import torchvision

DTYPES = {"F32": torch.float32, "I64": torch.int64, "I32": torch.int32}


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        buf = bytearray(raw[8 + n + a:8 + n + b])
        out[name] = torch.frombuffer(buf, dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


ap = argparse.ArgumentParser()
ap.add_argument("--weights", required=True)
ap.add_argument("--data", required=True)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--batch", type=int, default=128)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)

m = torchvision.models.resnet18(num_classes=10)
m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
m.maxpool = torch.nn.Identity()
state = load(args.weights)
missing = m.load_state_dict(state, strict=False)
assert not missing.unexpected_keys, missing
assert all(k.endswith("num_batches_tracked") for k in missing.missing_keys), missing
m.train()
data = load(args.data)
x, y = data["x"], data["y"]
batches = x.shape[0] // args.batch
opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
for s in range(args.steps):
    r0 = (s % batches) * args.batch
    opt.zero_grad()
    loss = F.cross_entropy(m(x[r0:r0 + args.batch]), y[r0:r0 + args.batch])
    loss.backward()
    opt.step()
    print("torch loss %d %.6f" % (s, loss.item()), flush=True)
