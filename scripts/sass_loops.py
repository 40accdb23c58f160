#!/usr/bin/env python3
"""Static instruction counts of a kernel's loops, from `cuobjdump -sass` output (no GPU needed).

  sass_loops.py SASS.txt NAME [--min N]         each loop of every function whose mangled name
                                                contains NAME: its address range (a backward
                                                branch and its target), instructions, opcode mix
  sass_loops.py SASS.txt NAME --range START END the instructions from address START to END (hex)

SASS.txt: `cuobjdump -sass OBJECT > SASS.txt` (cuobjdump comes with the CUDA toolkit, or from
the PyPI wheel nvidia-cuda-cuobjdump: its nvidia/cu13/bin/cuobjdump). A loop's count is static:
every instruction between the branch's target and the branch, taken or not; nested loops are
listed each. docs/bench/cuda_history.md quotes these counts for the hot loops of the decode kernels.
"""
import argparse
import collections
import re
import signal
import sys

INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def functions(text):
    """(name, [(address, opcode, operands)]) per function of the dump."""
    parts = re.split(r"\n\s*Function : ", text)
    out = []
    for part in parts[1:]:
        name = part.split("\n", 1)[0].strip()
        body = []
        for line in part.split("\n"):
            m = INSTRUCTION.match(line)
            if m:
                body.append((int(m.group(1), 16), m.group(3), m.group(4)))
        out.append((name, body))
    return out


def mix(ops, top=14):
    c = collections.Counter(op.split(".")[0] for op in ops)
    return " ".join(f"{k}:{v}" for k, v in c.most_common(top))


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sass")
    ap.add_argument("name")
    ap.add_argument("--min", type=int, default=100, help="smallest loop listed (instructions)")
    ap.add_argument("--range", nargs=2, metavar=("START", "END"))
    args = ap.parse_args()
    try:
        text = open(args.sass).read()
    except OSError as e:
        sys.exit(f"sass_loops: {args.sass}: {e.strerror}")
    found = [(n, b) for n, b in functions(text) if args.name in n]
    if not found:
        sys.exit(f"sass_loops: no function whose name contains {args.name!r} in {args.sass}")
    for name, body in found:
        print(f"{name}: {len(body)} instructions")
        if args.range:
            try:
                lo, hi = (int(x, 16) for x in args.range)
            except ValueError:
                sys.exit(f"sass_loops: --range wants two hexadecimal addresses, not {args.range}")
            ops = [op for a, op, _ in body if lo <= a <= hi]
            print(f"  {lo:#x}-{hi:#x}: {len(ops)} instructions  {mix(ops)}")
            continue
        for addr, op, operands in body:
            target = re.search(r"0x([0-9a-f]+)", operands)
            if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
                start = int(target.group(1), 16)
                ops = [o for a, o, _ in body if start <= a <= addr]
                if len(ops) >= args.min:
                    print(f"  loop {start:#x}-{addr:#x}: {len(ops)} instructions  {mix(ops)}")


if __name__ == "__main__":
    main()
