"""Bitwise A/B of two builds: the proof that a refactor left every result alone, or that a change
moved only the results it meant to. `save` runs fusednorm.group_norm forward and backward on fixed
inputs (seeded from each case's name, so independent of the build and of the case list's order)
over 10 shapes (both layouts, odd sizes, short rows in both) x 3 dtypes x 4 activations x 5 operand sets (none; scale,
shift, residual and multiplier; a multiplier; a residual; all four not requiring grad, which the
CUDA backwards treat apart) under each kernel path, and saves output and gradients; `compare`
reports how many outputs differ, and fails on any outside the cases matching --expect.

    # on the device, a build each (GPU_BUILD=DIR tools/gpu_prebuilt.sh py ...):
    python tools/bitwise_ab.py save /tmp/a.pt
    python tools/bitwise_ab.py save /tmp/b.pt
    python tools/bitwise_ab.py compare /tmp/a.pt /tmp/b.pt [--expect /gelu/]

On an H200 `save` takes ~40 s (1800 cases, 9360 outputs). On the
CPU (--device cpu) the kernel paths do not apply: one path.
"""

import argparse
import itertools
import re
import sys
import zlib

import torch

import fusednorm
from fusednorm.kernel_paths import selected

SHAPES = [  # shape, groups, channels_last
    ((2, 64, 24, 24), 8, False),
    ((2, 64, 24, 24), 8, True),
    ((1, 128, 64, 64), 32, False),
    ((3, 96, 17, 9), 6, False),  # odd sizes: scalar packs
    ((2, 320, 16, 16), 32, True),
    ((1, 32, 128, 128), 16, False),
    ((2, 24, 9, 7), 8, True),  # channels-last rows shorter than a vector: runs of rows
    ((2, 3, 20, 21), 1, True),
    ((4, 64, 7, 7), 32, False),  # channels-first rows of a few vectors: groups batched
    ((2, 40, 4, 4), 40, False),
]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ACTIVATIONS = [None, "silu", "gelu", "relu"]
OPERAND_SETS = ["none", "all", "multiplier", "residual", "all_without_grad"]
CUDA_PATHS = ["default", "split", "one_pass", "team", "sweep"]


def save(path, device):
    results = {}
    paths = CUDA_PATHS if device == "cuda" else ["default"]
    for (shape, groups, channels_last), dtype, act, operand_set in itertools.product(
            SHAPES, DTYPES, ACTIVATIONS, OPERAND_SETS):
        name = f"{shape}/{groups}/{channels_last}/{dtype}/{act}/{operand_set}"
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))

        def make(size):
            return (torch.randn(size, device=device, generator=gen) * 1.5 + 0.3).to(dtype)

        x = make(shape)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        N, C = shape[:2]
        weight, bias = make((C,)), make((C,))
        operands = {}
        if operand_set in ("all", "all_without_grad"):
            operands = dict(scale=make((N, C)), shift=make((N, C)), residual=make(shape), multiplier=make(shape))
        elif operand_set in ("multiplier", "residual"):
            operands = {operand_set: make(shape)}
        grad_out = make(shape)
        with_grad = operand_set != "all_without_grad"
        for kernel_path in paths:
            with selected(kernel_path):
                leaves = [t.detach().clone().requires_grad_() for t in [x, weight, bias]]
                kwargs = dict(operands)
                if with_grad:
                    kwargs = {k: v.detach().clone().requires_grad_() for k, v in operands.items()}
                    leaves += list(kwargs.values())
                y = fusednorm.group_norm(leaves[0], groups, leaves[1], leaves[2], activation=act, **kwargs)
                grads = torch.autograd.grad(y, leaves, grad_out)
                results[f"{name}/{kernel_path}"] = [y.detach().cpu()] + [g.cpu() for g in grads]
    torch.save(results, path)
    print(f"saved {len(results)} cases to {path}")


def compare(path_a, path_b, expect):
    a, b = torch.load(path_a), torch.load(path_b)
    if a.keys() != b.keys():
        sys.exit("the two files hold different cases")
    outputs = differ = unexpected = 0
    for key in a:
        for i, (s, t) in enumerate(zip(a[key], b[key])):
            outputs += 1
            if torch.equal(s.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)):
                continue
            differ += 1
            if expect is None or not re.search(expect, key):
                unexpected += 1
                if unexpected <= 20:
                    print(f"differs: {key} output {i}, max |a - b| {(s.double() - t.double()).abs().max().item():.3g}")
    print(f"{len(a)} cases, {outputs} outputs, {differ} differ, {unexpected} of them outside --expect {expect!r}")
    return unexpected == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("save")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p = sub.add_parser("compare")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--expect", default=None, help="regex of the case names allowed to differ")
    args = parser.parse_args()
    if args.command == "save":
        save(args.out, args.device)
    elif not compare(args.a, args.b, args.expect):
        sys.exit(1)


if __name__ == "__main__":
    main()
