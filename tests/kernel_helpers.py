"""Small shared helpers for the kernel tests."""

import torch


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def video_like_qkv(B, H, N, D, *, seed=0, dtype=torch.float32, layout="HND", outliers=True):
    """Random q, k, v with the structure that matters here: value tokens in a few clusters, a few
    outlier tokens with large norms, a spiking channel per head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g)
    k = torch.randn(B, H, N, D, generator=g) + 0.5  # a token-independent offset: K smoothing's job
    centers = torch.randn(B, H, 8, D, generator=g) * 2.0
    assign = torch.randint(0, 8, (B, H, N), generator=g)
    v = torch.gather(centers, 2, assign[..., None].expand(-1, -1, -1, D)) + 0.3 * torch.randn(B, H, N, D, generator=g)
    if outliers:
        idx = torch.randint(0, N, (max(1, N // 100),), generator=g)
        v[:, :, idx] *= 8.0
        v[:, torch.arange(H), :, torch.arange(H) % D] += 6.0
    out = [t.to(dtype) for t in (q, k, v)]
    if layout == "NHD":
        out = [t.transpose(1, 2).contiguous() for t in out]
    return out


_FMA_KERNEL = []


def fma_is_fused(device) -> bool:
    """Whether Triton's tl.fma rounds once on `device`: (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 fused,
    0 when the product is rounded first (Triton 3.8's interpreter does that; GPUs and 3.9's
    interpreter fuse). Needs Triton."""
    import triton
    import triton.language as tl

    if not _FMA_KERNEL:
        @triton.jit
        def fma_kernel(X, OUT):
            x = tl.load(X)
            tl.store(OUT, tl.fma(x, x, -(1.0 + 2.0 ** -11)))

        _FMA_KERNEL.append(fma_kernel)
    out = torch.empty(1, device=device)
    _FMA_KERNEL[0][(1,)](torch.tensor([1.0 + 2.0 ** -12], device=device), out)
    return out.item() == 2.0 ** -24
