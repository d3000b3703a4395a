"""The Triton kernels of ``fedfm_flower.learners.triton_scan`` (imported on first use: Triton
resolves a kernel's helpers from its module's globals, and only this module imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def softplus(raw):
    e = tl.exp(raw)
    w = 1.0 + e
    log1p = tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
    return tl.where(raw > 20.0, raw, log1p)


@triton.jit
def forward(
    u_ptr, d_ptr, A_ptr, B_ptr, C_ptr, y_ptr, rows, channels, steps, n,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, LAST_ONLY: tl.constexpr,
    SOFTPLUS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # = group * rows + row
    group = pid // rows
    c = tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_N)
    cm, km = c < channels, k < n
    mask = cm[:, None] & km[None, :]
    A = tl.load(A_ptr + (group * channels + c[:, None]) * n + k[None, :], mask=mask, other=0.0)
    base, bbase = pid * steps * channels, pid * steps * n
    h = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
    for t in range(steps):
        u = tl.load(u_ptr + base + t * channels + c, mask=cm, other=0.0).to(tl.float32)
        dt = tl.load(d_ptr + base + t * channels + c, mask=cm, other=0.0).to(tl.float32)
        if SOFTPLUS:
            dt = softplus(dt)
        b = tl.load(B_ptr + bbase + t * n + k, mask=km, other=0.0).to(tl.float32)
        cc = tl.load(C_ptr + bbase + t * n + k, mask=km, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt * u)[:, None] * b[None, :]
        y = tl.sum(h * cc[None, :], axis=1)
        if LAST_ONLY:
            if t == steps - 1:
                tl.store(y_ptr + pid * channels + c, y, mask=cm)
        else:
            tl.store(y_ptr + base + t * channels + c, y, mask=cm)


@triton.jit
def backward(
    u_ptr, d_ptr, A_ptr, B_ptr, C_ptr, dy_ptr, du_ptr, dd_ptr, dA_ptr, dB_ptr, dC_ptr,
    rows, channels, steps, n,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, LAST_ONLY: tl.constexpr,
    SOFTPLUS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    group = pid // rows
    c = tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_N)
    cm, km = c < channels, k < n
    mask = cm[:, None] & km[None, :]
    A = tl.load(A_ptr + (group * channels + c[:, None]) * n + k[None, :], mask=mask, other=0.0)
    base, bbase = pid * steps * channels, pid * steps * n
    dh = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
    dA = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
    for back in range(steps):
        t = steps - 1 - back
        # h_{t-1}, recomputed from the window's start
        h_prev = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
        for s in range(t):
            us = tl.load(u_ptr + base + s * channels + c, mask=cm, other=0.0).to(tl.float32)
            ds_ = tl.load(d_ptr + base + s * channels + c, mask=cm, other=0.0).to(tl.float32)
            if SOFTPLUS:
                ds_ = softplus(ds_)
            bs = tl.load(B_ptr + bbase + s * n + k, mask=km, other=0.0).to(tl.float32)
            h_prev = tl.exp(ds_[:, None] * A) * h_prev + (ds_ * us)[:, None] * bs[None, :]
        u = tl.load(u_ptr + base + t * channels + c, mask=cm, other=0.0).to(tl.float32)
        raw = tl.load(d_ptr + base + t * channels + c, mask=cm, other=0.0).to(tl.float32)
        dt = raw
        if SOFTPLUS:
            dt = softplus(raw)
        b = tl.load(B_ptr + bbase + t * n + k, mask=km, other=0.0).to(tl.float32)
        cc = tl.load(C_ptr + bbase + t * n + k, mask=km, other=0.0).to(tl.float32)
        decay = tl.exp(dt[:, None] * A)
        st = dt * u
        h = decay * h_prev + st[:, None] * b[None, :]
        if LAST_ONLY:
            scale = tl.where(t == steps - 1, 1.0, 0.0)
            dy = tl.load(dy_ptr + pid * channels + c, mask=cm, other=0.0).to(tl.float32) * scale
        else:
            dy = tl.load(dy_ptr + base + t * channels + c, mask=cm, other=0.0).to(tl.float32)
        tl.store(dC_ptr + bbase + t * n + k, tl.sum(dy[:, None] * h, axis=0), mask=km)
        d = dh + dy[:, None] * cc[None, :]
        grow = d * h_prev * decay  # d h_t / d (delta A); zero at t = 0 (h_prev = 0)
        dda = tl.sum(grow * A, axis=1)
        dA += grow * dt[:, None]
        ds = tl.sum(d * b[None, :], axis=1)
        tl.store(dB_ptr + bbase + t * n + k, tl.sum(d * st[:, None], axis=0), mask=km)
        dh = d * decay
        tl.store(du_ptr + base + t * channels + c, ds * dt, mask=cm)
        ddelta = ds * u + dda
        if SOFTPLUS:  # times sigmoid(raw)
            e = tl.exp(tl.minimum(raw, 20.0))
            ddelta = ddelta * tl.where(raw > 20.0, 1.0, e / (1.0 + e))
        tl.store(dd_ptr + base + t * channels + c, ddelta, mask=cm)
    offsets = (group * channels + c[:, None]) * n + k[None, :]
    tl.atomic_add(dA_ptr + offsets, dA, mask=mask)
