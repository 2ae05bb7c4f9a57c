"""Fits the polynomial of the CUDA kernels' GELU (gelu_cdf in csrc/cuda/group_norm_kernel.cu) and
reports its error. GELU(p) = p * Phi(p), Phi(p) = (1 + erf(p / sqrt2)) / 2; the kernels take
Phi(-|p|) = erfc(t) / 2 = 2^s(t), t = |p| / sqrt2, with s a degree-10 polynomial (one MUFU.EX2), and
Phi(|p|) = 1 - Phi(-|p|). Past TAIL, where float's 1 + erf(-t) is 0 (erfc(t) < 2^-25: eager's
float formula gives 0 there too), Phi(-|p|) is 0.

The fit: least squares reweighted towards minimax (Lawson), of log2(erfc(t) / 2) + 1 (s's constant
is -1, exact), the error weighted by max(erfc(t), 0.05): absolute in Phi where Phi(-|p|) is large,
relative in its tail (GELU's small outputs for negative p). Then Phi is evaluated as the kernels
do, in float32 (numpy, Horner with rounding a step, the ex2 exact: MUFU.EX2 adds up to 2^-22
relative), against float64 erfc and against eager float32's (1 + erf) / 2 with erf rounded once
(CUDA's erff is documented to 2 ulp, so eager's own error is up to about twice that shown).

    .venv/bin/python tools/fit_gelu_cdf.py [--degree 9]
"""
import argparse
import math

import numpy as np


def float32_erfc_half_tail():
    """The least float32 t with erfc(t) < 2^-25: beyond it float's 1 - erfc(t) rounds to 1."""
    t = np.float32(3.5)
    while math.erfc(float(t)) >= 2.0 ** -25:
        t = np.nextafter(t, np.float32(5))
    return t


def fit(degree, tail):
    t = np.linspace(0.0, float(tail), 60001)
    erfc = np.vectorize(math.erfc)(t)
    target = np.log2(erfc / 2) + 1  # s(t) + 1 = t * (c1 + c2 t + ...)
    basis = np.vstack([t ** (k + 1) for k in range(degree)]).T
    weight = np.maximum(erfc, 0.05)
    lawson = np.ones_like(t)
    for _ in range(200):
        w = weight * lawson
        c, *_ = np.linalg.lstsq(basis * w[:, None], target * w, rcond=None)
        err = np.abs((basis @ c - target) * weight)
        lawson = lawson * err / err.max() + 1e-14
        lawson /= lawson.mean()
    return [np.float32(-1.0)] + [np.float32(v) for v in c]


def phi_as_kernel(p, coefs, tail):
    """Phi(p) in float32 as gelu_cdf takes it."""
    p = p.astype(np.float32)
    t = (np.abs(p) * np.float32(0.70710678118654752440)).astype(np.float32)
    tc = np.minimum(t, tail)
    s = np.full_like(tc, coefs[-1])
    for c in reversed(coefs[:-1]):
        s = (s * tc + c).astype(np.float32)
    h = np.where(t < tail, np.exp2(s.astype(np.float64)).astype(np.float32), np.float32(0))
    return np.where(p >= 0, (np.float32(1) - h).astype(np.float32), h)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degree", type=int, default=10)
    args = parser.parse_args()
    tail = float32_erfc_half_tail()
    coefs = fit(args.degree, tail)
    print(f"TAIL = {float(tail):.9g}f")
    print("coefficients, constant first:")
    print(", ".join(f"{float(c):.9e}f" for c in coefs))
    p = np.linspace(-8.0, 8.0, 400001)
    exact = np.vectorize(lambda v: 0.5 * math.erfc(-v / math.sqrt(2)))(p)
    ours = phi_as_kernel(p, coefs, tail).astype(np.float64)
    p32 = p.astype(np.float32)
    erf32 = np.vectorize(lambda v: np.float32(math.erf(float(v))))(p32 * np.float32(0.70710678118654752440))
    eager = (np.float32(0.5) * (np.float32(1) + erf32.astype(np.float32))).astype(np.float64)
    for name, v in (("this fit", ours), ("eager float32 (1 + erf) / 2, erf rounded once", eager)):
        rel = np.abs(v - exact) / exact
        tail_side = (p < -1) & (np.abs(p) / math.sqrt(2) < float(tail))  # both give 0 past the tail
        print(f"{name}: max abs error {np.abs(v - exact).max():.2e}, max relative error for p < -1 "
              f"{rel[tail_side].max():.2e}")


if __name__ == "__main__":
    main()
