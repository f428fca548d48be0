#!/usr/bin/env python3
"""PyTorch DistributedDataParallel (gloo, CPU) on Fashion-MNIST: the reference for
`mpirun -np N tandem train` (bench/bench_ddp.py).

usage: $VENV/bin/python bench/torch_ddp.py --model mlp|cnn [--world 2] [--epochs 1]
           [--batch 64] [--optimizer sgd|adam] [--lr LR] [--momentum M] [--seed S] [--limit N]

The models and data of bench/torch_fmnist.py. --world processes (torch.multiprocessing.spawn),
each with one torch thread and one OpenBLAS thread; --batch is the global batch, each rank
taking batch/world samples per step from a DistributedSampler (shuffled by seed and epoch),
as `tandem train` does under mpirun. DDP averages the gradients, so every step is one
device's on the global batch. Epoch time = rank 0's training loop between two barriers;
the test set is evaluated on rank 0 after each epoch (not timed). The last line printed is
"RESULT {json}".
"""
import argparse
import json
import os
import time

ap = argparse.ArgumentParser()
ap.add_argument("--model", choices=["mlp", "cnn"], required=True)
ap.add_argument("--world", type=int, default=2)
ap.add_argument("--epochs", type=int, default=1)
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--optimizer", choices=["sgd", "adam"], default=None)
ap.add_argument("--lr", type=float, default=None)
ap.add_argument("--momentum", type=float, default=0.9)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--limit", type=int, default=0)
ap.add_argument("--port", type=int, default=29533)
args = ap.parse_args()

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402


def worker(rank, q):
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fmnist_common import load, make_model
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(args.seed)
    (xtr, ytr), (xte, yte) = load("train"), load("t10k")
    if args.limit:
        xtr, ytr = xtr[:args.limit], ytr[:args.limit]
        xte, yte = xte[:max(1, args.limit // 6)], yte[:max(1, args.limit // 6)]
    model = DDP(make_model(args.model))
    optimizer = args.optimizer or ("sgd" if args.model == "mlp" else "adam")
    lr = args.lr if args.lr is not None else (0.1 if optimizer == "sgd" else 1e-3)
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
           if optimizer == "sgd" else torch.optim.Adam(model.parameters(), lr=lr))
    sampler = DistributedSampler(range(len(xtr)), num_replicas=args.world, rank=rank,
                                 shuffle=True, seed=args.seed)
    per = args.batch // args.world
    epochs = []
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        idx_all = torch.tensor(list(sampler))
        dist.barrier()
        t0 = time.perf_counter()
        loss_sum, correct, seen = 0.0, 0, 0
        for i in range(0, len(idx_all), per):
            idx = idx_all[i:i + per]
            xb, yb = xtr[idx], ytr[idx]
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            correct += (out.argmax(1) == yb).sum().item()
            seen += len(idx)
        dist.barrier()
        dt = time.perf_counter() - t0
        if rank == 0:
            with torch.no_grad():
                out = model.module.eval()(xte)
                test_acc = (out.argmax(1) == yte).float().mean().item()
                model.module.train()
            n = seen * args.world
            epochs.append(dict(epoch=ep + 1, seconds=dt, img_s=n / dt, train_loss=loss_sum / seen,
                               test_acc=test_acc))
            print(f"torch-ddp {args.model} epoch {ep + 1}: {dt:.2f} s  {n / dt:.0f} img/s  "
                  f"train loss {loss_sum / seen:.4f}  test acc {test_acc:.4f}", flush=True)
    if rank == 0:
        q.put(epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(worker, args=(q,), nprocs=args.world, join=True)
    print("RESULT " + json.dumps(dict(model=args.model, world=args.world, torch=torch.__version__,
                                      epochs=q.get())))
