"""The simplest fast GroupNorm + SiLU: a baseline that fusednorm's kernel paths must beat.

The design of sglang's published Triton GroupNorm + SiLU (inference only, contiguous input):
a group of fewer than 2^18 elements is one program that sums x and x^2 and then re-reads the
group to write y; a larger group is split into chunks of 8192 elements, whose partial sums a
finalize kernel adds up before an apply kernel writes y. Statistics as E[x^2] - E[x]^2 in
float32, as there. Written here from that description for `peer_bench.py`; not part of the
library.
"""
import math

import torch
import triton
import triton.language as tl

BLOCK = 4096
CHUNK_BLOCKS = 2
LARGE_GROUP = 1 << 18


@triton.jit
def _block_sums(x_ptr, base, i, gsize):
    """Sum and sum of squares of the elements i (< gsize) of the group starting at base."""
    v = tl.load(x_ptr + base + i, mask=i < gsize, other=0.0).to(tl.float32)
    return tl.sum(v, 0), tl.sum(v * v, 0)


@triton.jit
def _write_block(x_ptr, w_ptr, b_ptr, y_ptr, base, i, gsize, c_first, HW, mean, rstd):
    """y = silu((x - mean) * rstd * w + b) at the elements i (< gsize) of the group starting at
    base, whose first channel is c_first."""
    m = i < gsize
    v = tl.load(x_ptr + base + i, mask=m, other=0.0).to(tl.float32)
    c = c_first + i // HW
    h = (v - mean) * rstd * tl.load(w_ptr + c, mask=m, other=1.0).to(tl.float32) \
        + tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + base + i, h * tl.sigmoid(h), mask=m)


@triton.jit
def _group_program(x_ptr, w_ptr, b_ptr, y_ptr, C, HW, cpg, gsize, eps, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64)
    base = n * C * HW + g * gsize
    offs = tl.arange(0, BLOCK)
    s = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    for start in range(0, gsize, BLOCK):
        bs, bq = _block_sums(x_ptr, base, start + offs, gsize)
        s += bs
        q += bq
    mean = s / gsize
    rstd = tl.rsqrt(q / gsize - mean * mean + eps)
    for start in range(0, gsize, BLOCK):
        _write_block(x_ptr, w_ptr, b_ptr, y_ptr, base, start + offs, gsize, g * cpg, HW, mean, rstd)


@triton.jit
def _chunk_sums(x_ptr, ps_ptr, pq_ptr, C, HW, G, gsize, nchunks, BLOCK: tl.constexpr, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    n = row // G
    base = n * C * HW + (row - n * G) * gsize
    offs = tl.arange(0, BLOCK)
    s = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    for j in range(NB):
        bs, bq = _block_sums(x_ptr, base, (k * NB + j) * BLOCK + offs, gsize)
        s += bs
        q += bq
    tl.store(ps_ptr + row * nchunks + k, s)
    tl.store(pq_ptr + row * nchunks + k, q)


@triton.jit
def _finalize(ps_ptr, pq_ptr, stats_ptr, nchunks, gsize, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    s = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    for start in range(0, nchunks, BLOCK):
        i = start + offs
        s += tl.sum(tl.load(ps_ptr + row * nchunks + i, mask=i < nchunks, other=0.0), 0)
        q += tl.sum(tl.load(pq_ptr + row * nchunks + i, mask=i < nchunks, other=0.0), 0)
    mean = s / gsize
    tl.store(stats_ptr + row * 2, mean)
    tl.store(stats_ptr + row * 2 + 1, tl.rsqrt(q / gsize - mean * mean + eps))


@triton.jit
def _apply(x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, C, HW, G, cpg, gsize, BLOCK: tl.constexpr, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    n = row // G
    g = row - n * G
    base = n * C * HW + g * gsize
    mean = tl.load(stats_ptr + row * 2)
    rstd = tl.load(stats_ptr + row * 2 + 1)
    offs = tl.arange(0, BLOCK)
    for j in range(NB):
        _write_block(x_ptr, w_ptr, b_ptr, y_ptr, base, (k * NB + j) * BLOCK + offs, gsize, g * cpg, HW, mean, rstd)


def group_norm_silu(x, num_groups, weight, bias, eps=1e-5):
    """silu(group_norm(x, num_groups, weight, bias, eps)) for a CUDA x of 2 to 5 dimensions."""
    x = x.contiguous()
    N, C = x.shape[:2]
    HW = math.prod(x.shape[2:])
    cpg = C // num_groups
    gsize = cpg * HW
    y = torch.empty_like(x)
    if gsize < LARGE_GROUP:
        _group_program[(num_groups, N)](x, weight, bias, y, C, HW, cpg, gsize, eps,
                                        BLOCK=min(BLOCK, triton.next_power_of_2(gsize)))
        return y
    rows = N * num_groups
    nchunks = triton.cdiv(gsize, BLOCK * CHUNK_BLOCKS)
    ps = torch.empty((rows, nchunks), device=x.device, dtype=torch.float32)
    pq = torch.empty_like(ps)
    stats = torch.empty((rows, 2), device=x.device, dtype=torch.float32)
    _chunk_sums[(rows, nchunks)](x, ps, pq, C, HW, num_groups, gsize, nchunks, BLOCK=BLOCK, NB=CHUNK_BLOCKS,
                                 num_warps=8, num_stages=3)
    _finalize[(rows,)](ps, pq, stats, nchunks, gsize, eps, BLOCK=min(1024, triton.next_power_of_2(nchunks)),
                       num_warps=4, num_stages=2)
    _apply[(rows, nchunks)](x, weight, bias, y, stats, C, HW, num_groups, cpg, gsize, BLOCK=BLOCK,
                            NB=CHUNK_BLOCKS, num_warps=8, num_stages=3)
    return y
