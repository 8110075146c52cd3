"""Lloyd k-means on the value tokens of one (batch, head): the grouping step of V-Smooth.

Plain and deterministic (bitwise, for a given seed): seeded initial centroids, assignment by the
smallest squared distance (ties to the lowest cluster index), update by the mean of the members;
an empty cluster keeps its previous centroid. After the last update one more assignment gives the
labels, so labels and returned centroids belong together.
"""

import torch


def initial_centroids(x: torch.Tensor, num_clusters: int, seed: int, groups=None) -> torch.Tensor:
    """x: [G, N, D] -> [G, C, D]: C distinct tokens per group, chosen by a seeded permutation
    (the same choice on every device: the generator runs on the CPU).

    groups: the index of each of x's groups in a larger tensor (None: 0 .. G-1). Group g's choice is
    the g-th draw of the generator, so the groups of a head subset (one rank's heads under Ulysses)
    start where the whole tensor's would."""
    G, N, _ = x.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    wanted = list(range(G)) if groups is None else [int(g) for g in groups]
    if len(wanted) != G or min(wanted) < 0:
        raise ValueError(f"groups must name {G} non-negative group indices, got {groups!r}")
    keep, draws = set(wanted), {}
    for g in range(max(wanted) + 1):
        perm = torch.randperm(N, generator=gen)[:num_clusters]
        if g in keep:
            draws[g] = perm
    idx = torch.stack([draws[g] for g in wanted])
    return torch.gather(x.float(), 1, idx.to(x.device)[..., None].expand(-1, -1, x.shape[-1]))


def assign(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """[G, N, D], [G, C, D] -> labels [G, N] int64 (argmin of ||x - c||^2, first index on ties)."""
    d = (centroids * centroids).sum(-1)[:, None, :] - 2.0 * x @ centroids.transpose(1, 2)
    return d.argmin(dim=-1)


def update(x: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Mean of each cluster's members; empty clusters keep their centroid."""
    G, C, D = centroids.shape
    sums = torch.zeros(G, C, D, dtype=x.dtype, device=x.device)
    sums.scatter_add_(1, labels[..., None].expand(-1, -1, D), x)
    counts = torch.zeros(G, C, dtype=x.dtype, device=x.device)
    counts.scatter_add_(1, labels, torch.ones_like(labels, dtype=x.dtype))
    return torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids)


def kmeans_reference(x: torch.Tensor, num_clusters: int, iters: int, init=None, seed: int = 0,
                     dtype=torch.float64):
    """x: [G, N, D] (G = batch x heads) -> (labels [G, N] int64, centroids [G, C, D] fp32).

    init: [G, C, D] centroids to start from (warm start) or None (seeded choice of tokens).
    C is capped at N.
    """
    x = x.to(dtype)
    if init is None:
        centroids = initial_centroids(x, min(num_clusters, x.shape[1]), seed).to(dtype)
    else:
        centroids = init.to(device=x.device, dtype=dtype)
    for _ in range(iters):
        centroids = update(x, assign(x, centroids), centroids)
    return assign(x, centroids), centroids.float()
