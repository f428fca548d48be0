#!/usr/bin/python3
"""Writes the hand-made seeds of the fuzz corpora (tests/fuzz/<target>_corpus/seed_*): a few
small valid inputs and a few broken ones for each reader, in the input layout its target
(tests/fuzz_<target>.c) expects, and tests/fuzz/cli.dict, the option names of `tandem train`
for libFuzzer's -dict. The other files of the corpora are inputs libFuzzer found (scripts/fuzz
merges them in) and regressions: crashes found by fuzzing, kept under their own names.

Run: /usr/bin/python3 tests/fuzz/make_seeds.py (needs only the standard library).
"""
import gzip
import os
import re
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def write(target, name, data):
    d = os.path.join(HERE, target + "_corpus")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed_" + name), "wb") as f:
        f.write(data)


def gz(data):
    return gzip.compress(data, mtime=0)


# ---- IDX: u16 labels length, the labels file, the images file -----------------------------
def idx_images(count, rows, cols, npix, magic=0x803):
    return struct.pack(">4I", magic, count, rows, cols) + bytes((7 * k) % 256 for k in range(npix))


def idx_labels(count, nlab, magic=0x801):
    return struct.pack(">2I", magic, count) + bytes(k % 3 for k in range(nlab))


def idx(name, labels, images):
    write("idx", name, struct.pack("<H", len(labels)) + labels + images)


img, lab = idx_images(5, 3, 4, 60), idx_labels(5, 5)
idx("raw", lab, img)
idx("gz", gz(lab), gz(img))
idx("gz_two_members", lab, gz(img[:30]) + gz(img[30:]))
idx("gz_trailing_garbage", lab, gz(img) + b"garbage")
idx("gz_truncated", lab, gz(img)[:-12])
bad_crc = bytearray(gz(img))
bad_crc[-6] ^= 0x5A
idx("gz_bad_crc", lab, bytes(bad_crc))
idx("trailing_data", lab, img + b"\0")
idx("wrong_magic", lab, idx_images(5, 3, 4, 60, magic=0x802))
idx("count_mismatch", idx_labels(6, 6), img)
idx("dims_overflow", idx_labels(0xFFFFFFFF, 0), idx_images(0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
idx("zero_dim", lab, idx_images(5, 0, 4, 0))
idx("gz_bomb_claim", lab, gz(idx_images(5, 100000, 100000, 60)))
idx("short_header", lab, img[:10])

# ---- llm.c token shards: context - 1, vocab index (fuzz_tokens.c), the shard --------------
def shard(tokens, magic=20240520, version=1, count=None):
    h = [magic, version, len(tokens) if count is None else count] + [0] * 253
    return struct.pack("<256i", *h) + struct.pack("<%dH" % len(tokens), *tokens)


def tok(name, context, vocab_index, data):
    write("tokens", name, bytes([context - 1, vocab_index]) + data)


toks = [3, 1, 4, 1, 5, 9, 2, 6, 5]
tok("valid", 2, 2, shard(toks))  # vocab 10
tok("valid_vocab_u16", 4, 7, shard([65535, 0, 1, 2, 65534]))
tok("token_over_vocab", 2, 2, shard(toks + [10]))
tok("wrong_magic", 2, 2, shard(toks, magic=20240326))
tok("version_2", 2, 2, shard(toks, version=2))
tok("count_truncated", 2, 2, shard(toks, count=100))
tok("count_negative", 2, 2, shard(toks, count=-1))
tok("too_short_for_context", 9, 2, shard(toks))
tok("header_only", 1, 3, shard([], count=0))

# ---- CSV: flags byte (bit 0 header, bits 1-3 label column + 4), the file -------------------
def csv(name, text, label_column=-1, header=False):
    write("csv", name, bytes([int(header) | (label_column + 4) << 1]) + text.encode())


csv("header_label_last", "a,b,label\n0.5,1e-3,1\n-2,3.25,0\n", -1, True)
csv("label_first_crlf", "2,0.1,0.2\r\n\r\n0,  7 ,\t8\r\n", 0)
csv("ragged", "1,2,0\n1,2\n")
csv("nan_inf", "nan,1,0\ninf,2,1\n")
csv("f32_overflow", "1e39,0\n")
csv("label_negative", "1,-1\n")
csv("label_huge", "1,99999999999999999999\n")
csv("not_a_number", "1,abc,0\n")
csv("field_too_long", "1" * 80 + ",0\n")
csv("nul_byte", "1,\0,0\n")
csv("one_column", "1\n2\n")
csv("label_column_out_of_range", "1,0\n", 3)
csv("header_only", "a,b\n", -1, True)
csv("empty", "")

# ---- llm.c model files ----------------------------------------------------------------------
def model(maxT, V, L, NH, C, Vp, magic=20240326, version=3, extra=0, params=None):
    h = struct.pack("<256i", magic, version, maxT, V, L, NH, C, Vp, *([0] * 248))
    n = Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C if params is None else params
    return h + struct.pack("<%df" % (n + extra), *[0.25 * (k % 7) - 0.5 for k in range(n + extra)])


write("llmc", "valid_tiny", model(2, 3, 1, 1, 2, 4))
write("llmc", "valid_two_heads", model(3, 5, 1, 2, 2, 5))
write("llmc", "wrong_magic", model(2, 3, 1, 1, 2, 4, magic=20240520))
write("llmc", "version_5_bf16", model(2, 3, 1, 1, 2, 4, version=5))
write("llmc", "zero_layers", model(2, 3, 0, 1, 2, 4))
write("llmc", "heads_do_not_divide", model(2, 3, 1, 3, 2, 4, params=100))
write("llmc", "padded_below_vocab", model(2, 5, 1, 1, 2, 4))
write("llmc", "trailing_bytes", model(2, 3, 1, 1, 2, 4, extra=1))
write("llmc", "truncated_params", model(2, 3, 1, 1, 2, 4)[:-4])
write("llmc", "truncated_header", model(2, 3, 1, 1, 2, 4)[:100])
# sizes at the limit: the parameter count must not overflow (it did: 12 * C * C * L > 2^63)
write("llmc", "max_dims", model(1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, params=0))

# ---- `tandem train`'s arguments, NUL-separated ------------------------------------------------
def cli(name, *args):
    write("cli", name, b"\0".join(a.encode() for a in args))


cli("mlp", "--model", "mlp", "--epochs", "3", "--lr=0.05", "--batch-size", "32")
cli("cnn_adam", "--model=cnn", "--optimizer", "adam", "--schedule", "cosine", "--warmup-steps",
    "10", "--plot", "a.svg", "--quiet")
cli("gpt", "--model", "gpt", "--data", "book.txt", "--layers", "2", "--heads", "2", "--channels",
    "64", "--context", "32", "--vocab", "256", "--save", "m.bin", "--clip-grad", "1")
cli("devices", "--devices", "cpu:0,cpu:1", "--batch-per-device", "8", "--grad-accum", "2")
cli("pipeline", "--devices", "4", "--model-split", "2", "--micro-batches", "2", "--pipeline",
    "gpipe")
cli("checkpoint", "--checkpoint-dir", "ck", "--checkpoint-every", "5", "--keep", "2", "--resume",
    "--max-steps", "100", "--seed", "7")
cli("help", "--epochs", "2", "--help")
cli("unknown_option", "--colour", "red")
cli("missing_value", "--epochs")
cli("bad_number", "--lr", "1e999")
cli("flag_with_value", "--quiet=yes")
cli("value_is_option", "--data", "--model")
cli("devices_bad", "--devices", "cpu:,,cuda:99")

names = sorted(set(re.findall(r'\{"(--[a-z0-9-]+)"', open(os.path.join(ROOT, "tools", "train.c")).read())))
with open(os.path.join(HERE, "cli.dict"), "w") as f:
    f.write("# `tandem train`'s options (tools/train.c), for libFuzzer's -dict; "
            "written by make_seeds.py\n")
    for i, n in enumerate(names):
        f.write('opt%d="%s"\n' % (i, n))
    for i, v in enumerate(["gpt", "mlp", "cnn", "adamw", "adam", "sgd", "cosine", "step",
                           "cpu:all", "cpu:0", "cuda:0", "1f1b", "gpipe", "flush", "keep", "\\x00"]):
        f.write('val%d="%s"\n' % (i, v))
print("seeds written")
