"""Rewrites CUDA launches `k<<<grid, block, shmem, stream>>>(args)` of a .cu file into
`emu_launch(grid, block, emu_bind([](auto... a) { k(a...); }, args), shmem, &k, stream, "k")` for the
host emulation (see emu.cpp; &k only with dynamic shared memory; the arguments evaluated at the
launch and kept by value, as a GPU's launch and a recorded one in a CUDA graph keep them),
and `extern __shared__ T name[];` (the launch's dynamic shared memory) into a pointer to the
block the emulation allocates for that launch; nvcc's `#pragma unroll` lines go."""
import re
import sys


def split_top(s):
    """The comma-separated parts of s outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        if ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts]


def transform(src):
    """src with every launch rewritten (the launch's argument list is matched by parens)."""
    out, pos = [], 0
    for m in re.finditer(r"([A-Za-z_][A-Za-z_0-9]*(?:<[A-Za-z_0-9, ]+>)?)\s*<<<", src):
        if m.start() < pos:
            continue
        end_cfg = src.index(">>>", m.end())
        cfg = split_top(src[m.end():end_cfg])
        i = src.index("(", end_cfg)
        depth, j = 0, i
        while True:
            depth += src[j] == "("
            depth -= src[j] == ")"
            if depth == 0:
                break
            j += 1
        args = src[i + 1:j]
        out.append(src[pos:m.start()])
        shmem = cfg[2] if len(cfg) > 2 else "0"
        # the kernel, for the shared memory cudaFuncSetAttribute gave it (a launch with dynamic
        # shared memory names its template arguments; others may leave them deduced)
        kernel = "nullptr" if shmem == "0" else f"(const void *)&{m.group(1)}"
        stream = cfg[3] if len(cfg) > 3 else "0"
        bound = ", " + args if args.strip() else ""
        out.append(f"emu_launch((long long)({cfg[0]}), (long long)({cfg[1]}), emu_bind([](auto... a) {{ {m.group(1)}(a...); }}{bound}), (size_t)({shmem}), {kernel}, {stream}, \"{m.group(1)}\")")
        pos = j + 1
    out.append(src[pos:])
    out = re.sub(r"^[ \t]*#pragma unroll.*$", "", "".join(out), flags=re.M)  # nvcc's, not g++'s
    return re.sub(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_0-9]+)\s+([A-Za-z_0-9]+)\s*\[\s*\]\s*;",
                  r"\1 *\2 = (\1 *)emu_dynamic_shared;", out)


sys.stdout.write(transform(open(sys.argv[1]).read()))
