#!/usr/bin/env python3
"""The PyTorch side of bench_gpt: a byte-level GPT-2 trained for --steps steps, timed per step.

usage: $VENV/bin/python bench/torch_gpt.py [--dir /tmp/tandem_bench_gpt] [--steps 40] [--threads 1]
                                          [--device cpu|cuda] [--layers 2] [--channels 128]
                                          [--heads 4] [--context 64] [--batch 4]
                                          [--autocast none|bf16|fp16] [--attention sdpa|manual]
                                          [--adamw fused|foreach|default]

Config (../shared/baseline/README.md, section 6): 2 layers, 128 channels, 4 heads, context
64, batch 4, vocabulary 256 (bytes), no dropout; AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8,
weight decay 0.1 on matrices only. Text: the license files of /usr/share/common-licenses
listed below, as bytes. Batch k is tokens [k*B*T, (k+1)*B*T + 1) (llm.c's sequential loader).

Writes into --dir what bench_gpt reads, so both sides start from the same weights and see
the same batches:
  model.bin    the initial weights as an llm.c fp32 checkpoint (GPT-2 init, seed 0)
  tokens.bin   the text as an llm.c token shard (magic 20240520, version 1, u16 tokens)
  torch.txt    one line per step: "step loss ms"
--autocast bf16 (fp16) runs forward and loss under torch.autocast(device, dtype=torch.bfloat16
(float16)), PyTorch's mixed precision for issue 37; the parameters, the optimizer and the
initial weights written to model.bin stay fp32, so bench_gpt starts from the same weights. fp16
on a GPU also scales the loss with torch.amp.GradScaler, as a user of fp16 must.
--attention sdpa (the default) is F.scaled_dot_product_attention(is_causal=True), what a PyTorch
user writes (nanoGPT's fast path): its flash kernel in bf16/fp16 on a GPU, its memory-efficient
one in fp32 (3xTF32 on the tensor cores from sm_80), its fused CPU kernel on a CPU. --attention
manual is nanoGPT's slow path (q k^T, masked_fill, softmax, @ v: the T x T scores stored), the
baseline of the figures measured before 2026-12-07 (bench/RESULTS.md says which).
--adamw: torch.optim.AdamW's fused kernel (the default on a GPU, as nanoGPT asks for it there),
its foreach one, or PyTorch's own default (the default on a CPU, where it is a loop over the
tensors, the baseline of every CPU figure; on a GPU it is foreach, the baseline until
2026-12-07).
Step time = forward + backward + optimizer step (batches are prepared before timing, on the
device; loss.item() ends each step, as the Tandem trainer reads each step's loss).
"""
import argparse
import math
import os
import struct
import time

ap = argparse.ArgumentParser()
ap.add_argument("--dir", default="/tmp/tandem_bench_gpt")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--device", default="cpu")
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--channels", type=int, default=128)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--context", type=int, default=64)
ap.add_argument("--batch", type=int, default=4, help="bench_gpt --batch must be the same")
ap.add_argument("--autocast", choices=["none", "bf16", "fp16"], default="none",
                help="forward and loss under torch.autocast in this dtype")
ap.add_argument("--attention", choices=["sdpa", "manual"], default="sdpa",
                help="F.scaled_dot_product_attention (default) or the unfused products")
ap.add_argument("--adamw", choices=["fused", "foreach", "default"], default=None,
                help="AdamW's implementation (default: fused on a GPU, PyTorch's default on a CPU)")
args = ap.parse_args()
os.environ["OMP_NUM_THREADS"] = str(args.threads)
os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)

import torch  # noqa: E402  (after the thread settings)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

L, C, NH, T, B, V = args.layers, args.channels, args.heads, args.context, args.batch, 256
LIC = "/usr/share/common-licenses"
TEXT_FILES = ["Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.2", "GFDL-1.3", "GPL-1", "GPL-2",
              "GPL-3", "LGPL-2", "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0"]
# those of the files this system has (Ubuntu's base-files lacks some of Debian's): both sides
# read the same tokens.bin
text = b"".join(open(os.path.join(LIC, f), "rb").read() for f in TEXT_FILES
                if os.path.exists(os.path.join(LIC, f)))
while len(text) < args.steps * B * T + 1:  # a large model's batches: the text again
    text += text
data = torch.tensor(list(text), dtype=torch.long)
torch.set_num_threads(args.threads)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x):
        Bn, Tn, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q = q.view(Bn, Tn, NH, C // NH).transpose(1, 2)
        k = k.view(Bn, Tn, NH, C // NH).transpose(1, 2)
        v = v.view(Bn, Tn, NH, C // NH).transpose(1, 2)
        if args.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // NH))
            att = att.masked_fill(~self.mask[:Tn, :Tn], float("-inf")).softmax(-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(Bn, Tn, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        for n, p in self.named_parameters():  # GPT-2's initialisation
            if n.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if "proj" in n else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # the tied head
        return F.cross_entropy(logits.view(-1, V), tgt.view(-1))


def llmc_params(m):
    """The weights in llm.c's order, each kind stacked over the layers."""
    hs = m.h
    kinds = [[m.wte.weight], [m.wpe.weight], [b.ln_1.weight for b in hs], [b.ln_1.bias for b in hs],
             [b.c_attn.weight for b in hs], [b.c_attn.bias for b in hs],
             [b.c_proj.weight for b in hs], [b.c_proj.bias for b in hs],
             [b.ln_2.weight for b in hs], [b.ln_2.bias for b in hs], [b.c_fc.weight for b in hs],
             [b.c_fc.bias for b in hs], [b.mlp_proj.weight for b in hs],
             [b.mlp_proj.bias for b in hs], [m.ln_f.weight], [m.ln_f.bias]]
    return torch.cat([t.detach().reshape(-1) for k in kinds for t in k])


model = GPT()
os.makedirs(args.dir, exist_ok=True)
with open(os.path.join(args.dir, "model.bin"), "wb") as f:
    f.write(struct.pack("<256i", *([20240326, 3, T, V, L, NH, C, V] + [0] * 248)))
    f.write(llmc_params(model).numpy().astype("<f4").tobytes())
with open(os.path.join(args.dir, "tokens.bin"), "wb") as f:
    f.write(struct.pack("<256i", *([20240520, 1, len(text)] + [0] * 253)))
    f.write(data.numpy().astype("<u2").tobytes())

dev = torch.device(args.device)
model.to(dev)
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
adamw = args.adamw or ("fused" if dev.type == "cuda" else "default")
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, betas=(0.9, 0.999),
                        eps=1e-8, **{"fused": {"fused": True}, "foreach": {"foreach": True},
                                     "default": {}}[adamw])
batches = []
for k in range(args.steps):
    chunk = data[k * B * T:(k + 1) * B * T + 1]
    batches.append((chunk[:-1].view(B, T).to(dev), chunk[1:].view(B, T).to(dev)))
amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.autocast]
# fp16's range needs loss scaling; bf16 has fp32's (GradScaler(enabled=False) just steps)
scaler = torch.amp.GradScaler(dev.type, enabled=args.autocast == "fp16" and dev.type == "cuda")
lines = []
for step, (x, y) in enumerate(batches):
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    lv = loss.item()
    ms = (time.perf_counter() - t0) * 1e3
    lines.append("%d %.9g %.4f\n" % (step, lv, ms))
with open(os.path.join(args.dir, "torch.txt"), "w") as f:
    f.writelines(lines)
first = 5 if len(lines) > 5 else 0  # the warm-up steps left out, but for a short run
ms = sorted(float(s.split()[2]) for s in lines[first:])
print("torch %s on %s, %d thread(s), autocast %s, attention %s, AdamW %s, OPENBLAS_CORETYPE=%s: "
      "%d steps, median %.2f ms/step (steps %d-%d), loss %s -> %s"
      % (torch.__version__, args.device, args.threads, args.autocast, args.attention, adamw,
                         os.environ.get("OPENBLAS_CORETYPE"),
                         args.steps, ms[len(ms) // 2], first, args.steps - 1, lines[0].split()[1],
                         lines[-1].split()[1]))
