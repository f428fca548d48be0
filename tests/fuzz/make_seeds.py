#!/usr/bin/python3
"""Writes the hand-made seeds of the fuzz corpora (tests/fuzz/<target>_corpus/seed_*): a few
small valid inputs and a few broken ones for each reader, in the input layout its target
(tests/fuzz_<target>.c) expects, and tests/fuzz/cli.dict, the option names of `tandem train`
for libFuzzer's -dict. The other files of the corpora are inputs libFuzzer found (scripts/fuzz
merges them in) and regressions: crashes found by fuzzing, kept under their own names.

Run: /usr/bin/python3 tests/fuzz/make_seeds.py (needs only the standard library).
"""
import gzip
import json
import os
import re
import struct
import zlib

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
def model_bf16(maxT, V, L, NH, C, Vp, extra=0):
    """llm.c's bf16 file (version 5): the parameters as the top halves of exact floats."""
    f32 = model(maxT, V, L, NH, C, Vp, version=5, extra=extra)
    vals = struct.unpack("<%df" % ((len(f32) - 1024) // 4), f32[1024:])
    return f32[:1024] + b"".join(struct.pack("<f", v)[2:] for v in vals)


# an f32 body under version 5's header: twice the bytes version 5 needs
write("llmc", "version_5_bf16", model(2, 3, 1, 1, 2, 4, version=5))
write("llmc", "valid_v5_bf16", model_bf16(2, 3, 1, 1, 2, 4))
write("llmc", "v5_trailing_byte", model_bf16(2, 3, 1, 1, 2, 4) + b"\0")
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

# ---- images: a byte choosing the channels (bit 0: 1, else 3) and a part (bit 1; bits 2-7 place
# its box), then a PNG or JPEG file ----------------------------------------------------------
PNG_SIG = b"\x89PNG\r\n\x1a\n"


def png_chunk(tag, data, crc_ok=True):
    crc = zlib.crc32(tag + data) ^ (0 if crc_ok else 0xFFFFFFFF)
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)


def png_file(w, h, depth, ctype, rows, plte=None, interlace=0, crc_ok=True, sig=PNG_SIG):
    """rows: the filtered scanlines (filter byte, then the row's bytes), every pass's in order"""
    ihdr = struct.pack(">2I5B", w, h, depth, ctype, 0, 0, interlace)
    out = sig + png_chunk(b"IHDR", ihdr)
    if plte:
        out += png_chunk(b"PLTE", plte)
    return out + png_chunk(b"IDAT", zlib.compress(rows), crc_ok) + png_chunk(b"IEND", b"")


def adam7_rows(w, h, pixel):
    """8-bit grey Adam7 scanlines of pixel(x, y), filter 0"""
    rows = b""
    for x0, y0, dx, dy in ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4),
                           (1, 0, 2, 2), (0, 1, 1, 2)):
        for y in range(y0, h, dy):
            line = bytes(pixel(x, y) for x in range(x0, w, dx))
            if line:
                rows += b"\0" + line
    return rows


def image(name, data, channels=3, part=None):
    """part: None for the whole image, else (top, left) in eighths of the image"""
    ctl = (1 if channels == 1 else 0) | (0 if part is None else 2 | part[0] << 2 | part[1] << 5)
    write("image", name, bytes([ctl]) + data)

# tiny JPEGs made by TurboJPEG (tjCompress2, quality 75): 8x8 grey, 16x8 RGB 4:2:0, 8x8 RGB
# progressive; the standard library has no JPEG encoder
JPEG_GREY_8X8 = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb00430008060607060508070707090908"
    "0a0c140d0c0b0b0c1912130f141d1a1f1e1d1a1c1c20242e2720222c231c1c2837292c303134"
    "34341f27393d38323c2e333432ffc0000b080008000801011100ffc4001f0000010501010101"
    "010100000000000000000102030405060708090a0bffc400b510000201030302040305050404"
    "0000017d01020300041105122131410613516107227114328191a1082342b1c11552d1f02433"
    "627282090a161718191a25262728292a3435363738393a434445464748494a53545556575859"
    "5a636465666768696a737475767778797a838485868788898a92939495969798999aa2a3a4a5"
    "a6a7a8a9aab2b3b4b5b6b7b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4e5e6"
    "e7e8e9eaf1f2f3f4f5f6f7f8f9faffda0008010100003f008353b4b7f0e793e27d09bcbd3669"
    "552eacd14edb676ce1d71c2c64f1838dac401c300bffd9"
)
JPEG_RGB420_16X8 = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb00430008060607060508070707090908"
    "0a0c140d0c0b0b0c1912130f141d1a1f1e1d1a1c1c20242e2720222c231c1c2837292c303134"
    "34341f27393d38323c2e333432ffdb0043010909090c0b0c180d0d1832211c21323232323232"
    "3232323232323232323232323232323232323232323232323232323232323232323232323232"
    "323232323232ffc00011080008001003012200021101031101ffc4001f000001050101010101"
    "0100000000000000000102030405060708090a0bffc400b51000020103030204030505040400"
    "00017d01020300041105122131410613516107227114328191a1082342b1c11552d1f0243362"
    "7282090a161718191a25262728292a3435363738393a434445464748494a535455565758595a"
    "636465666768696a737475767778797a838485868788898a92939495969798999aa2a3a4a5a6"
    "a7a8a9aab2b3b4b5b6b7b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4e5e6e7"
    "e8e9eaf1f2f3f4f5f6f7f8f9faffc4001f010003010101010101010101000000000000010203"
    "0405060708090a0bffc400b51100020102040403040705040400010277000102031104052131"
    "061241510761711322328108144291a1b1c109233352f0156272d10a162434e125f11718191a"
    "262728292a35363738393a434445464748494a535455565758595a636465666768696a737475"
    "767778797a82838485868788898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7"
    "b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae2e3e4e5e6e7e8e9eaf2f3f4f5f6f7f8f9"
    "faffda000c03010002110311003f00648214549a054101557f2e38d4aa448c7cb03823696c63"
    "1bd738da257cb07c658831c9bc121a372625eac774e4e5bb701b2d8ff9e8e4feee8a2aaa2e5b"
    "5bcff0575fd76339cb91dacbfa6d7f5f7ee7ffd9"
)
JPEG_RGB_PROGRESSIVE_8X8 = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb00430008060607060508070707090908"
    "0a0c140d0c0b0b0c1912130f141d1a1f1e1d1a1c1c20242e2720222c231c1c2837292c303134"
    "34341f27393d38323c2e333432ffdb0043010909090c0b0c180d0d1832211c21323232323232"
    "3232323232323232323232323232323232323232323232323232323232323232323232323232"
    "323232323232ffc20011080008000803011100021101031101ffc40014000100000000000000"
    "000000000000000002ffc4001501010100000000000000000000000000000102ffda000c0301"
    "00021003100000012cff00ffc4001510010100000000000000000000000000000022ffda0008"
    "01010001050297ffc4001c1100010305000000000000000000000000010011f00212213191ff"
    "da0008010301013f01b28c39937d0ebfffc4001a1100010501000000000000000000000000f0"
    "0003113151a1ffda0008010201013f0187342babffc4001a1001000105000000000000000000"
    "0000000100214151b1f1ffda0008010100063f02a025b1cd33ffc4001c100100000701000000"
    "00000000000000000100112131415171a1ffda0008010100013f21d1685d242d38b1e11fffda"
    "000c03010002000300000010ff00ffc4001b1101010001050000000000000000000000012111"
    "0031417191ffda0008010301013f1000c1bdbef318372603afffc4001a110100020301000000"
    "000000000000000001112100315141ffda0008010201013f1014b86f9ef14b476884a1379fff"
    "c40017100101010100000000000000000000000001112141ffda0008010100013f101002096a"
    "5e2d85df01a8ff00ffd9"
)


grey8 = png_file(4, 3, 8, 0, b"".join(b"\0" + bytes(range(40 * y, 40 * y + 4)) for y in range(3)))
image("png_grey8", grey8)
image("png_grey8_to_grey", grey8, 1)
image("png_rgb8", png_file(3, 2, 8, 2, b"\0" + bytes(range(9)) + b"\1" + bytes(range(9, 18))))
image("png_rgba8_to_grey", png_file(2, 2, 8, 6, b"\0" + bytes(range(8)) + b"\2" + bytes(8)), 1)
image("png_palette4", png_file(3, 1, 4, 3, b"\0\x12\x00", plte=bytes([255, 0, 0, 0, 255, 0, 1, 2, 3])))
image("png_grey16", png_file(3, 1, 16, 0, b"\0\x00\xff\x80\x7f\xff\xff"))
image("png_grey2", png_file(4, 1, 2, 0, b"\0\x1b"))
image("png_grey_alpha8", png_file(2, 1, 8, 4, b"\0\x4d\x00\xc8\xff"))
image("png_rgb16_paeth", png_file(2, 1, 16, 2, b"\4" + bytes(range(12))))
image("png_adam7", png_file(9, 9, 8, 0, adam7_rows(9, 9, lambda x, y: (x * 17 + y * 5) % 256),
                            interlace=1))
image("png_bad_idat_crc", png_file(4, 3, 8, 0, b"\0" * 15, crc_ok=False))
image("png_bad_signature", png_file(4, 3, 8, 0, b"\0" * 15, sig=b"\x89PNG\r\n\0\n"))
image("png_truncated", grey8[: len(grey8) - 20])
image("png_huge", png_file(100000, 100000, 8, 0, b"\0"))
image("png_palette_missing", png_file(2, 1, 8, 3, b"\0\0\1"))
image("empty", b"")
image("text", b"This is a text file, not a JPEG.\n")
image("jpeg_grey", JPEG_GREY_8X8)
image("jpeg_rgb420", JPEG_RGB420_16X8)
image("jpeg_rgb420_to_grey", JPEG_RGB420_16X8, 1)
image("jpeg_progressive", JPEG_RGB_PROGRESSIVE_8X8)
image("jpeg_rgb420_part", JPEG_RGB420_16X8, part=(2, 4))
image("jpeg_progressive_part_grey", JPEG_RGB_PROGRESSIVE_8X8, 1, part=(4, 1))
image("jpeg_truncated_part", JPEG_RGB420_16X8[: len(JPEG_RGB420_16X8) * 3 // 4], part=(0, 0))
image("png_part", grey8, part=(1, 1))
image("jpeg_truncated", JPEG_RGB420_16X8[: len(JPEG_RGB420_16X8) * 3 // 4])
image("jpeg_header_only", JPEG_GREY_8X8[:40])
image("jpeg_corrupt_scan", JPEG_GREY_8X8[:-8] + b"\xff\x00\xff\xd0" + JPEG_GREY_8X8[-4:])

# ---- a sharded checkpoint's layout.safetensors (fuzz_layout.c: its scratch checkpoint holds
# "0.weight" [3, 3] and "0.bias" [3], 12 elements, in shard files of 1 and of 2 ranks) --------
LAYOUT = {"tandem.sharded": "1", "world": "2", "total": "12", "params": "2",
          "optim.kind": "adam", "optim.states": "exp_avg,exp_avg_sq",
          "param.0": "0 2 3 3 0.weight", "param.1": "9 1 3 0.bias", "rank.0": "0 5",
          "rank.1": "5 12"}


def layout(name, changes=None, drop=()):
    meta = {k: v for k, v in LAYOUT.items() if k not in drop}
    meta.update(changes or {})
    h = json.dumps({"__metadata__": meta}, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    write("layout", name, struct.pack("<Q", len(h)) + h)


layout("valid_world2")
layout("valid_world1", {"world": "1", "rank.0": "0 12"}, drop=("rank.1",))
layout("valid_no_states", {"optim.states": ""})
layout("valid_overlapping", {"param.1": "0 1 3 0.bias"})
layout("offset_9e18", {"param.1": "9000000000000000000 1 3 0.bias"})
layout("offset_1e8", {"param.1": "100000000 1 3 0.bias"})
layout("offset_just_past", {"param.1": "10 1 3 0.bias"})
layout("offset_negative", {"param.1": "-1 1 3 0.bias"})
layout("offset_overflows", {"param.1": "99999999999999999999 1 3 0.bias"})
layout("dims_2_32", {"param.0": "0 2 4294967296 4294967296 0.weight"})
layout("ndim_9", {"param.0": "0 9 1 1 1 1 1 1 1 1 1 0.weight"})
layout("dim_negative", {"param.0": "0 2 3 -3 0.weight"})
layout("name_repeated", {"param.1": "9 1 3 0.weight"})
layout("name_empty", {"param.1": "9 1 3 "})
layout("name_reserved", {"param.1": "9 1 3 __metadata__"})
layout("params_huge", {"params": "1000000"})
layout("params_one_missing", {"params": "3"})
layout("param_beyond", {"param.7": "0 1 1 x"})
layout("total_huge", {"total": "4611686018427387904", "rank.1": "5 4611686018427387904"})
layout("rank_gap", {"rank.1": "6 12"})
layout("world_3", {"world": "3"})
layout("states_missing_in_shards", {"optim.states": "exp_avg,nothing"})
layout("states_too_many", {"optim.states": "a,b,c,d"})
write("layout", "not_safetensors", b"garbage")

# ---- a checkpoint's train_state.safetensors (fuzz_train_state.c: its scratch checkpoint
# ckpt-0000000003 holds Sequential(Linear(2, 2)) and is loaded with Adam and a loader of 8
# samples in batches of 2); the tampered fields of issue 36 among the seeds ----------------
STATE = {"tandem.checkpoint": "1", "step": "3", "optim.kind": "adam", "optim.steps": "3",
         "optim.lr": "0x1.0624dep-10", "loader.epoch": "1", "loader.global_sample": "2",
         "loader.sample": "2", "loader.batch": "1", "rng.seed": "1", "rng.offset": "14"}
MOMENTS = [("0.weight", [2, 2]), ("0.bias", [2])]


def train_state(name, changes=None, drop=(), values=None):
    meta = {k: v for k, v in STATE.items() if k not in drop}
    meta.update(changes or {})
    header, data = {"__metadata__": meta}, b""
    for state in ("exp_avg", "exp_avg_sq"):
        for param, shape in MOMENTS:
            n = shape[0] * (shape[1] if len(shape) > 1 else 1)
            header[f"optim.{param}.{state}"] = {"dtype": "F32", "shape": shape,
                                                "data_offsets": [len(data), len(data) + 4 * n]}
            data += struct.pack(f"<{n}f", *((values or {}).get(f"{param}.{state}", [0.5] * n)))
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    write("train_state", name, struct.pack("<Q", len(h)) + h + data)


train_state("valid")
train_state("valid_epoch0", {"loader.epoch": "0", "loader.global_sample": "6"})
train_state("step_negative", {"step": "-5"})
train_state("step_max", {"step": "9223372036854775807"})
train_state("step_not_dir", {"step": "4"})
train_state("optim_steps_negative", {"optim.steps": "-1"})
train_state("optim_steps_text", {"optim.steps": "3x"})
train_state("lr_nan", {"optim.lr": "nan"})
train_state("lr_negative", {"optim.lr": "-0.1"})
train_state("epoch_negative", {"loader.epoch": "-1"})
train_state("sample_not_batch_start", {"loader.global_sample": "3"})
train_state("sample_negative", {"loader.global_sample": "-2"})
train_state("sample_huge", {"loader.global_sample": "9223372036854775807"})
train_state("legacy_position", {"loader.batch": "9"}, drop=("loader.global_sample",))
train_state("seed_missing", drop=("rng.seed",))
train_state("kind_sgd", {"optim.kind": "sgd"})
train_state("moment_nan", values={"0.bias.exp_avg": [float("nan"), 0.0]})
train_state("moment_sq_negative", values={"0.weight.exp_avg_sq": [0.5, -1.0, 0.5, 0.5]})

names = sorted(set(re.findall(r'\{"(--[a-z0-9-]+)"', open(os.path.join(ROOT, "tools", "train.c")).read())))
with open(os.path.join(HERE, "cli.dict"), "w") as f:
    f.write("# `tandem train`'s options (tools/train.c), for libFuzzer's -dict; "
            "written by make_seeds.py\n")
    for i, n in enumerate(names):
        f.write('opt%d="%s"\n' % (i, n))
    for i, v in enumerate(["gpt", "mlp", "cnn", "adamw", "adam", "sgd", "cosine", "step",
                           "cpu:all", "cpu:0", "cuda:0", "1f1b", "gpipe", "flush", "keep", "fmnist-fast",
                           "cnn-bn", "onecycle", "\\x00"]):
        f.write('val%d="%s"\n' % (i, v))
print("seeds written")
