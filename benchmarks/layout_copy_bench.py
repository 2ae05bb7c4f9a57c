"""An operand in the layout other than the input's (docs/design.md, "Layout copies"): what copying
it costs inside `add_group_norm`, against ATen's copy of the permuted view and a clone (the
roofline), on the HunyuanVideo decoder's shapes and a few smaller ones, in one run.

    python benchmarks/layout_copy_bench.py [--strided-rows]

With --strided-rows: operands whose rows are contiguous but whose other strides are any (a video's
frames as Mochi's per-frame norms take them, slices), which to_layout copies channels-first with
the replication pad's row kernels and no padding: that copy against ATen's `.contiguous()` and a
clone (the roofline), and `group_norm` of the operand against `group_norm` of its dense copy.

Medians in ms of `bench.timer` (CUDA events after an L2 flush). "CL+CF" is add_group_norm with a
channels-last input and a contiguous `other`, "CL+CL" the same with both channels-last; their
difference is the copy of `other` into the input's layout (CF+CL and CF+CF the reverse). "equal"
checks that the mixed call's results equal the same-layout call's bit for bit. Needs a CUDA device.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusednorm  # noqa: E402
from bench import timer  # noqa: E402

SHAPES = [((1, 128, 9, 480, 640), torch.float16), ((1, 256, 9, 240, 320), torch.float16),
          ((2, 320, 64, 64), torch.float16), ((1, 512, 3, 60, 80), torch.float16),
          ((8, 64, 128, 128), torch.float32)]


def frames(n, c, t, h, w, dtype):
    """The frames (N * T, C, H, W) of a video (N, C, T, H, W) stored NCDHW: a view where N is 1."""
    return torch.randn(n, c, t, h, w, device="cuda", dtype=dtype).transpose(1, 2).flatten(0, 1)


STRIDED = [  # (name, make operand)
    ("Mochi frames (7,128,480,848)", lambda: frames(1, 128, 7, 480, 848, torch.float16)),
    ("Mochi frames (7,512,120,212)", lambda: frames(1, 512, 7, 120, 212, torch.float16)),
    ("frames (16,64,32,32) fp32", lambda: frames(1, 64, 16, 32, 32, torch.float32)),
    ("frames (16,64,8,8)", lambda: frames(1, 64, 16, 8, 8, torch.float16)),
    ("channels [:, ::2] (8,320,64,64)", lambda: torch.randn(8, 640, 64, 64, device="cuda", dtype=torch.float16)[:, ::2]),
    ("batch [::2] (4,128,96,96)", lambda: torch.randn(8, 128, 96, 96, device="cuda", dtype=torch.float16)[::2]),
]


def strided_rows(t):
    pad = torch.ops.fusednorm.replication_pad
    for name, make in STRIDED:
        x = make()
        zeros = [0] * (2 * (x.dim() - 2))
        dense = x.contiguous()
        assert x.stride(-1) == 1 and not x.is_contiguous() and torch.equal(pad(x, zeros), dense)
        G = 32
        aten = t(lambda: x.contiguous())
        ours = t(lambda: pad(x, zeros))
        clone = t(lambda: dense.clone())
        gn = t(lambda: fusednorm.group_norm(x, G))
        gn_dense = t(lambda: fusednorm.group_norm(dense, G))
        print(f"{name:32s} clone {clone:.4f}  ATen copy {aten:.4f}  row kernels {ours:.4f} | "
              f"group_norm {gn:.4f} (of the dense copy {gn_dense:.4f})", flush=True)


def main():
    if not torch.cuda.is_available():
        sys.exit("layout_copy_bench.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, ms")
    t = timer("cuda")
    if "--strided-rows" in sys.argv[1:]:
        return strided_rows(t)
    add = torch.ops.fusednorm.add_group_norm
    for shape, dtype in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        cl = x.movedim(1, -1).contiguous().movedim(-1, 1)
        w = torch.randn(shape[1], device="cuda", dtype=dtype)
        G = 32 if shape[1] % 32 == 0 else 8
        aten_to_cf = t(lambda: cl.contiguous())
        aten_to_cl = t(lambda: x.movedim(1, -1).contiguous())
        clone = t(lambda: x.clone())
        same = t(lambda: add(cl, cl, G, w, w, 1e-5))
        mixed = t(lambda: add(cl, x, G, w, w, 1e-5))
        same_cf = t(lambda: add(x, x, G, w, w, 1e-5))
        mixed_cf = t(lambda: add(x, cl, G, w, w, 1e-5))
        a, b = add(cl, x, G, w, w, 1e-5), add(cl, cl.clone(), G, w, w, 1e-5)
        equal = all(torch.equal(p, q) for p, q in zip(a, b))
        print(f"{str(shape):22s} {str(dtype)[6:]:8s} clone {clone:.4f}  ATen CL->CF {aten_to_cf:.4f} "
              f"CF->CL {aten_to_cl:.4f} | add_gn CL+CL {same:.4f} CL+CF {mixed:.4f} (copy {mixed - same:+.4f}) | "
              f"CF+CF {same_cf:.4f} CF+CL {mixed_cf:.4f} (copy {mixed_cf - same_cf:+.4f}) equal={equal}", flush=True)


if __name__ == "__main__":
    main()
