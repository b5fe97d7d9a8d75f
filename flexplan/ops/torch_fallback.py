"""The ops in torch alone, for tensors no kernel can run on: CPU tensors where Triton's kernels
are compiled ones (a GPU machine, or none, without TRITON_INTERPRET=1). spconv runs its layers
on CPU tensors too; here they are right and slow (gathered blocks of bounded size, one matmul or
reduction each), never a launch that fails deep in Triton.

Same maps and the same sums as the kernels (the planner's torch backend makes CPU plans), with
fp32 accumulation for 16-bit inputs (fp64 for float64).
"""
from __future__ import annotations

import torch

from ..kernel_configs import EXPLICIT_WORKSPACE_BYTES
from ..plan import MISSING


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the ops sum in, kernels and this module alike: float64 for float64 inputs, else
    float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_chunks(m: int, row_bytes: int):
    """(start, stop) row ranges whose gathered block stays within EXPLICIT_WORKSPACE_BYTES."""
    rows = max(1, EXPLICIT_WORKSPACE_BYTES // max(row_bytes, 1))
    for start in range(0, m, rows):
        yield start, min(m, start + rows)


def gather_rows(src: torch.Tensor, nmap: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """[M, V, K]: src's row nmap[m, v] at (m, v), `fill` where the map has MISSING."""
    padded = torch.cat([src, src.new_full((1, src.shape[1]), fill)])
    index = torch.where(nmap == MISSING, src.shape[0], nmap).long()
    return padded[index]


def gather_gemm(src, weight, bias, nmap, reverse: bool, part: str) -> torch.Tensor:
    """ops.conv.gather_gemm's sums: fwd out[m] = sum_v W[:, v, :] @ src[nmap[m, v]];
    dgrad (weight [Co, V, Ci], src the output gradient) out[m] = sum_v W[:, v, :]^T @
    src[nmap[m, v']], v' = V - 1 - v when reverse (a submanifold map read backwards)."""
    co, v, ci = weight.shape
    acc = accumulator_dtype(src.dtype)
    if reverse:
        nmap = nmap.flip(1)
    w = weight.to(acc)
    # fwd: [M, V*Ci] @ [V*Ci, Co]; dgrad: [M, V*Co] @ [V*Co, Ci]
    w2 = w.reshape(co, v * ci).t() if part == "fwd" else w.permute(1, 0, 2).reshape(v * co, ci)
    m = nmap.shape[0]
    out = torch.empty((m, w2.shape[1]), dtype=acc, device=src.device)
    for start, stop in _row_chunks(m, v * src.shape[1] * 8):
        cols = gather_rows(src, nmap[start:stop]).to(acc).reshape(stop - start, -1)
        out[start:stop] = cols @ w2
    if bias is not None:
        out += bias.to(acc)
    return out.to(src.dtype)


def wgrad(grad_out, src, nmap, weight_shape) -> torch.Tensor:
    """ops.conv.wgrad's sums over the fwd map: grad_w[:, v, :] = sum_m grad_out[m]^T src[nmap[m, v]]
    ([Co, V, Ci], fp32 / fp64 accumulation)."""
    co, v, ci = weight_shape
    acc = accumulator_dtype(src.dtype)
    grad_w = torch.zeros((co, v * ci), dtype=acc, device=src.device)
    for start, stop in _row_chunks(nmap.shape[0], v * ci * 8):
        cols = gather_rows(src, nmap[start:stop]).to(acc).reshape(stop - start, -1)
        grad_w += grad_out[start:stop].to(acc).t() @ cols
    return grad_w.reshape(co, v, ci)


def pool(feats, nmap, mode: str, zero_floor: bool) -> torch.Tensor:
    """ops.pool.sparse_pool's outputs, differentiable through torch: the max (floored at 0 with
    zero_floor; a window with no input gives 0) or the mean over the inputs present."""
    if mode == "max":
        windows = gather_rows(feats, nmap, fill=float("-inf"))
        out = windows.max(dim=1).values  # (its gradient: to the first input holding the max)
        if zero_floor:  # as the kernel: no gradient at a max <= 0, and NaN floors to 0
            return torch.where(out > 0, out, 0).to(feats.dtype)
        has_input = (nmap != MISSING).any(1, keepdim=True)  # an empty window gives 0
        return torch.where(has_input, out, 0).to(feats.dtype)
    windows = gather_rows(feats.to(accumulator_dtype(feats.dtype)), nmap)
    count = (nmap != MISSING).sum(1, keepdim=True).clamp_min(1)
    return (windows.sum(1) / count).to(feats.dtype)
