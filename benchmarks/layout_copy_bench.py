"""An operand in the layout other than the input's (docs/design.md, "Layout copies"): what copying
it costs inside `add_group_norm`, against ATen's copy of the permuted view and a clone (the
roofline), on the HunyuanVideo decoder's shapes and a few smaller ones, in one run.

    python benchmarks/layout_copy_bench.py

Medians in ms of `bench.timer` (CUDA events after an L2 flush). "CL+CF" is add_group_norm with a
channels-last input and a contiguous `other`, "CL+CL" the same with both channels-last; their
difference is the copy of `other` into the input's layout (CF+CL and CF+CF the reverse). "equal"
checks that the mixed call's results equal the same-layout call's bit for bit. Needs a CUDA device.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusednorm  # noqa: E402,F401  (registers the ops)
from bench import timer  # noqa: E402

SHAPES = [((1, 128, 9, 480, 640), torch.float16), ((1, 256, 9, 240, 320), torch.float16),
          ((2, 320, 64, 64), torch.float16), ((1, 512, 3, 60, 80), torch.float16),
          ((8, 64, 128, 128), torch.float32)]


def main():
    if not torch.cuda.is_available():
        sys.exit("layout_copy_bench.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, ms")
    t = timer("cuda")
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
