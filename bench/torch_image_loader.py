#!/usr/bin/env python3
"""The PyTorch side of bench_image_loader: torchvision's ImageFolder + DataLoader over a JPEG
folder, RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize(ImageNet), batch
32, shuffle, W worker processes; images/s over full epochs after a warm-up epoch.

usage: $VENV/bin/python bench/torch_image_loader.py DIR [--workers W] [--epochs 2]
                                                    [--backend pil|tensor]

--backend pil: the default pipeline of the tutorials and of torchvision's reference scripts
  (PIL decode via ImageFolder's default loader, transforms on PIL images, then ToTensor and
  Normalize).
--backend tensor: torchvision.io.decode_jpeg (libjpeg-turbo, to uint8 CHW) and
  transforms.v2 on the uint8 tensor (its fast uint8 antialiased resize), then
  ToDtype(float32, scale=True) and Normalize: torchvision's fastest CPU path.
Both use persistent workers (no process start per epoch, the faster setting) and torch's
default of one intra-op thread per worker. Prints "torch epoch <images/s>" per timed epoch,
then "torch median <images/s>", which bench_image_loader reads back.
"""
import argparse
import statistics
import time

import torch
import torchvision
from torch.utils.data import DataLoader

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--workers", type=int, default=1)
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--backend", choices=["pil", "tensor"], default="pil")
args = ap.parse_args()
torch.set_num_threads(1)  # the main process only collects batches
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

if args.backend == "pil":
    from torchvision import transforms as T
    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(args.dir, transform=tf)
else:
    from torchvision.io import ImageReadMode, decode_jpeg, read_file
    from torchvision.transforms import v2

    def load(path):
        return decode_jpeg(read_file(path), mode=ImageReadMode.RGB)

    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(args.dir, transform=tf, loader=load)

dl = DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                persistent_workers=args.workers > 0)
rates = []
for e in range(args.epochs + 1):  # epoch 0 warms the page cache and starts the workers
    t0 = time.perf_counter()
    n = 0
    for x, y in dl:
        n += x.shape[0]
    dt = time.perf_counter() - t0
    if e > 0:
        rates.append(n / dt)
        print("torch epoch %.1f" % (n / dt), flush=True)
print("torch median %.1f" % statistics.median(rates), flush=True)
