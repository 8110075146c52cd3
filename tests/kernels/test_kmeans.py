"""k-means (V-Smooth's grouping): the reference against a plain textbook Lloyd, warm starts,
empty clusters, reproducibility, and the plan it yields."""

import pytest
import torch

from vc_attention.kernels import VSmoothPlan, plan_v_smooth
from vc_attention.kernels.reference.kmeans import kmeans_reference

from kernel_helpers import video_like_qkv


def textbook_lloyd(x, centroids, iters):
    """One group, loops and all: the definition the reference must agree with."""
    c = centroids.clone().double()
    x = x.double()
    for _ in range(iters + 1):
        labels = torch.tensor([int(torch.argmin(((c - row) ** 2).sum(-1))) for row in x])
        if _ == iters:
            break
        for j in range(c.shape[0]):
            members = x[labels == j]
            if len(members):
                c[j] = members.mean(0)
    return labels, c


def separated(G=2, N=400, D=16, C=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(G, C, D, generator=g) * 20
    truth = torch.randint(0, C, (G, N), generator=g)
    x = torch.gather(centers, 1, truth[..., None].expand(-1, -1, D)) + torch.randn(G, N, D, generator=g) * 0.1
    return x, truth, centers


def same_partition(a, b):
    """Labels agree up to renaming the clusters."""
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_reference_equals_textbook_lloyd():
    x, _, _ = separated(G=1, N=120, D=8, C=4, seed=1)
    x = x + torch.randn_like(x) * 8  # overlapping clusters, so iterations matter
    init = x[:, :6].clone()
    labels, cents = kmeans_reference(x, 6, 4, init=init)
    tl, tc = textbook_lloyd(x[0], init[0], 4)
    assert torch.equal(labels[0], tl)
    assert torch.allclose(cents[0].double(), tc, atol=1e-5)


def test_well_separated_clusters_are_found():
    x, truth, centers = separated()
    # warm start from perturbed true centres: every cluster found exactly
    labels, _ = kmeans_reference(x, 5, 3, init=centers + 0.5)
    for g in range(x.shape[0]):
        assert same_partition(labels[g], truth[g])


def test_warm_start_uses_the_given_centroids():
    x, _, centers = separated()
    init = centers + 0.5
    labels0, c0 = kmeans_reference(x, 5, 0, init=init)  # zero iterations: nothing moves
    assert torch.equal(c0, init.float())
    plan = plan_v_smooth(x[None], init=init[None], iters=0, backend="reference")
    assert torch.equal(plan.centroids[0], init.float())
    # and the plan can be passed as init itself
    plan2 = plan_v_smooth(x[None], init=plan, iters=1, backend="reference")
    assert plan2.centroids.shape == plan.centroids.shape


def test_empty_cluster_keeps_its_centroid():
    x, _, centers = separated(C=3)
    far = torch.full((x.shape[0], 1, x.shape[2]), 1e4)
    init = torch.cat([centers, far], dim=1)  # the 4th centroid attracts nobody
    labels, cents = kmeans_reference(x, 4, 3, init=init)
    assert not (labels == 3).any()
    assert torch.equal(cents[:, 3], far[:, 0])
    assert not torch.isnan(cents).any()


def test_same_seed_same_plan_bitwise_and_other_seed_differs():
    _, _, v = video_like_qkv(1, 2, 300, 32, seed=2)
    a = plan_v_smooth(v, num_clusters=16, seed=7, backend="reference")
    b = plan_v_smooth(v, num_clusters=16, seed=7, backend="reference")
    c = plan_v_smooth(v, num_clusters=16, seed=8, backend="reference")
    assert torch.equal(a.perm, b.perm) and torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.centroids, c.centroids)


def test_plan_is_a_stable_sort_of_the_labels():
    _, _, v = video_like_qkv(2, 3, 257, 32, seed=4)
    plan = plan_v_smooth(v, num_clusters=8, backend="reference")
    assert isinstance(plan, VSmoothPlan)
    assert plan.perm.shape == (2, 3, 257) and plan.centroids.shape == (2, 3, 8, 32)
    sorted_labels = torch.gather(plan.labels, 2, plan.perm)
    assert torch.all(sorted_labels[..., 1:] >= sorted_labels[..., :-1])
    # stable: inside a cluster, the original order is kept
    same = sorted_labels[..., 1:] == sorted_labels[..., :-1]
    assert torch.all(plan.perm[..., 1:][same] > plan.perm[..., :-1][same])
    assert torch.equal(plan.counts.sum(-1), torch.full((2, 3), 257))
    inv = plan.inverse()
    assert torch.equal(torch.gather(plan.perm, 2, inv), torch.arange(257).expand(2, 3, 257))


def test_plan_layouts_agree():
    _, _, v = video_like_qkv(1, 2, 100, 16, seed=5)
    a = plan_v_smooth(v, num_clusters=4, backend="reference")
    b = plan_v_smooth(v.transpose(1, 2).contiguous(), num_clusters=4, layout="NHD", backend="reference")
    assert torch.equal(a.perm, b.perm)


def test_more_clusters_than_tokens_is_capped():
    v = torch.randn(1, 1, 5, 8)
    plan = plan_v_smooth(v, num_clusters=64, backend="reference")
    assert plan.centroids.shape == (1, 1, 5, 8)


@pytest.mark.parametrize("bad", [dict(num_clusters=0), dict(iters=-1), dict(layout="BHND")])
def test_plan_rejects_bad_options(bad):
    with pytest.raises(ValueError):
        plan_v_smooth(torch.randn(1, 1, 10, 8), backend="reference", **bad)


def test_plan_rejects_mismatched_init():
    with pytest.raises(ValueError, match="init centroids"):
        plan_v_smooth(torch.randn(1, 2, 10, 8), init=torch.randn(1, 3, 4, 8), backend="reference")
