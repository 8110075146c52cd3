"""V-Smooth's exact parts: joint K/V permutation, 128-row block means, residual.

For non-causal attention, permuting keys and values together (and any per-key bias with them)
leaves softmax(Q K^T) V unchanged; only Q's rows define the output order, and Q is not permuted.
"""

import torch

V_BLOCK = 128  # rows per mean block: one hardware tile of the PV matmul


def permute_tokens(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x: [B, H, N, D], perm: [B, H, N] (x'[t] = x[perm[t]]) -> [B, H, N, D]."""
    return torch.gather(x, 2, perm[..., None].expand(-1, -1, -1, x.shape[-1]))


def block_means(v: torch.Tensor, block: int = V_BLOCK, store_dtype=torch.bfloat16) -> torch.Tensor:
    """v: [B, H, N, D] -> mu [B, H, ceil(N/block), D], the mean of each block over its valid rows
    (a last partial block averages only what it holds), rounded to store_dtype (16-bit: 0.125 bit
    per value element) and returned as fp32 so the residual is taken against the stored value."""
    B, H, N, D = v.shape
    nb = -(-N // block)
    vp = torch.nn.functional.pad(v.float(), (0, 0, 0, nb * block - N)).reshape(B, H, nb, block, D)
    counts = torch.full((nb,), float(block), device=v.device)
    counts[-1] = N - (nb - 1) * block
    mu = vp.sum(dim=3) / counts[:, None]
    return mu.to(store_dtype).float() if store_dtype is not None else mu


def demean(v: torch.Tensor, mu: torch.Tensor, block: int = V_BLOCK) -> torch.Tensor:
    """Residual R = V - mu of its block (mu already rounded: restoration is then exact)."""
    N = v.shape[2]
    return v - mu.repeat_interleave(block, dim=2)[:, :, :N]
