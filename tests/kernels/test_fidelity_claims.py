"""Pin the qualitative fidelity claims of V-Smooth / ExpCast on a small probe built from a real clip.

The probe is the harness's (vc_attention.kernels.fidelity.probes) at a reduced size: Wan 2.2 14B preview,
16 px patches, 4 latent frames (N = 4 x 21 x 21 = 1764 tokens), 2 heads, D = 128. The full-size
numbers are in FIDELITY.md; these tests only check directions that held there too:

- k-means order removes more block energy (128-row block means) than sequential order;
- V-Smooth's E4M3 residual error is below sequential-order demeaning, and its ratio follows the
  energy left: MSE_kmeans / MSE_seq ~ (1 - share_kmeans) / (1 - share_seq) (E4M3's error is relative);
- the V-Smooth output error (library reference pipeline, k-means plan) is below naive FP8's, but only
  by a small margin on these probes (see FIDELITY.md: the value term is dominated by E4M3's relative
  rounding, which demeaning reduces only in proportion to the energy it removes);
- ExpCast's per-row TV stays below the Proposition 3.1 bound 3.64% + tau on every row.
"""

import math

import pytest
import torch

pytest.importorskip("PIL", reason="the probes decode the clips with Pillow (pip install -e \".[test]\")")
from vc_attention.kernels.fidelity import probes  # noqa: E402
from vc_attention.kernels.fidelity import simulate as sim  # noqa: E402

if probes.VIDEO_DIR is None:
    pytest.skip(probes.VIDEO_MISSING, allow_module_level=True)

from vc_attention.kernels.plan import plan_v_smooth  # noqa: E402
from vc_attention.kernels.reference.attention import reference_vc_attention  # noqa: E402


@pytest.fixture(scope="module")
def probe():
    torch.manual_seed(0)
    return probes.build_probe(clip="wan22_14b", patch=16, latent_frames=4, heads=2)


@pytest.fixture(scope="module")
def plan(probe):
    return plan_v_smooth(probe.v, num_clusters=64, iters=10, backend="reference")


def test_probe_shape_and_outliers(probe):
    assert probe.grid == (4, 21, 21)
    assert tuple(probe.v.shape) == (1, 2, 1764, 128)
    # outlier tokens carry the largest value norms; spiking channels differ between heads
    norms = probe.v[0].norm(dim=-1)
    for h in range(2):
        assert norms[h][probe.outlier_tokens[h]].min() > norms[h][~probe.outlier_tokens[h]].max()
    assert set(probe.spike_channels[0].tolist()) != set(probe.spike_channels[1].tolist())


def test_kmeans_removes_more_block_energy_than_sequential(probe, plan):
    cube = probes.cube_order(probe.grid)
    for h in range(2):
        v = probe.v[0, h]
        seq, _ = sim.energy_share(v)
        cub, _ = sim.energy_share(v[cube])
        km, _ = sim.energy_share(v[plan.perm[0, h]])
        assert km > seq + 0.05, (h, seq, km)
        assert km > cub, (h, cub, km)


def test_value_error_follows_energy_left(probe, plan):
    for h in range(2):
        v = probe.v[0, h]
        perm = plan.perm[0, h]
        mse_seq, _ = sim.v_quant_error(v)
        mse_km, _ = sim.v_quant_error(v[perm])
        assert mse_km < mse_seq
        share_seq, _ = sim.energy_share(v)
        share_km, _ = sim.energy_share(v[perm])
        predicted = (1 - share_km) / (1 - share_seq)
        assert abs(mse_km / mse_seq - predicted) < 0.05, (mse_km / mse_seq, predicted)


def test_vsmooth_output_error_below_naive_fp8(probe, plan):
    qidx = sim.query_blocks(probe.n, 2, seed=7)
    q = probe.q[:, :, qidx]
    o_ref = torch.softmax(q.double() @ probe.k.double().transpose(-1, -2) * 128 ** -0.5, -1) @ probe.v.double()
    naive = reference_vc_attention(q, probe.k, probe.v, v_smooth=False, expcast=False)
    vs = reference_vc_attention(q, probe.k, probe.v, v_smooth=True, expcast=False, perm=plan.perm)
    for h in range(2):
        e_naive = (naive[0, h].double() - o_ref[0, h]).norm()
        e_vs = (vs[0, h].double() - o_ref[0, h]).norm()
        gain_db = 20 * math.log10(e_naive / e_vs)
        assert gain_db > 0.1, (h, gain_db)


def test_expcast_tv_within_bound(probe):
    rows, agree = sim.expcast_rows(probe.q[0, 0, :512], probe.k[0, 0])
    assert (rows["tv_expcast"] < sim.TV_BOUND + rows["tau_sub"]).all()
    assert rows["tv_expcast"].max() < sim.TV_BOUND
    share = agree["normal_equal"] / agree["normal_total"]
    assert 0.75 < share < 0.85  # paper: 79.6% over one doubling
    assert agree["off_by_more"] == 0


def test_4bit_default_beats_plain_nvfp4_on_the_probe(probe, plan):
    """FIDELITY.md, 4-bit: the 4-bit default (V-Smooth with a mean per 8 tokens, and the Q/K/V
    group-scale search) is at least 2 dB closer to exact attention than plain NVFP4 (no demeaning,
    the usual amax scales), V-Smooth alone is too, and each part adds to the other; the paper's one
    mean per 128-row block gains much less (on FIDELITY.md's probes: the default +2.9 / +3.4 / +3.1
    dB, V-Smooth alone +2.2 / +2.8 / +2.5, with the block mean +1.2 / +1.4 / +1.3)."""
    q, k, v = probe.q, probe.k, probe.v
    rows = torch.arange(512)
    qs = q[:, :, rows]
    ref = torch.softmax(qs.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v.double()

    def sqnr(**kw):
        o = reference_vc_attention(qs, k, v, bits=4, **kw).double()
        return 10 * math.log10((ref ** 2).sum().item() / ((o - ref) ** 2).sum().item())

    plain = sqnr(v_smooth=False, nvfp4_search="")
    v_smooth_only = sqnr(perm=plan.perm, nvfp4_search="")
    search_only = sqnr(v_smooth=False)
    v_search = sqnr(perm=plan.perm, nvfp4_search="v")
    default = sqnr(perm=plan.perm)
    block = sqnr(perm=plan.perm, v_mean_group=128)
    # this probe (16 px patches): 23.6 plain, 25.6 V-Smooth alone, 24.3 the search alone, 26.1 with
    # V's search only, 26.4 the default, 24.4 the default with the block mean
    assert default > plain + 2.0 and v_smooth_only > plain + 1.5, (plain, v_smooth_only, default)
    assert default > max(v_smooth_only, search_only, v_search), (v_smooth_only, search_only, v_search, default)
    assert default > block + 1.5, (block, default)

def test_v_in_two_terms_beats_the_default_and_comfy_kitchen_on_the_probe(probe, plan):
    """FIDELITY.md, "V in two E4M3 terms": V's residual as two E4M3 terms on one per-channel scale
    (reference v_terms=2, the kernels' launch option) takes V's term out of the 8-bit default's error
    (E4M3 V's 4 significant bits are most of it on these probes): on every head the output is at
    least 6 dB closer to exact attention than the default's and closer than our model of
    comfy-kitchen's INT8 attention (simulate's "comfy_kitchen"), by more than 3 dB on the mean; exp2 +
    cast with the two terms is closer still (ExpCast's P term is then the larger one). On
    FIDELITY.md's CPU probes: +11.5 / +20.6 / +18.2 dB over the default on clean / peaked / noisy
    probes, +4.8 / +14.0 / +11.5 over comfy-kitchen."""
    qidx = sim.query_blocks(probe.n, 2, seed=7)
    q = probe.q[:, :, qidx]
    o_ref = torch.softmax(q.double() @ probe.k.double().transpose(-1, -2) * 128 ** -0.5, -1) @ probe.v.double()

    def sqnr(o, h):
        return 10 * math.log10((o_ref[0, h] ** 2).sum().item() / ((o[0, h].double() - o_ref[0, h]) ** 2).sum().item())

    default = reference_vc_attention(q, probe.k, probe.v, v_smooth=True, expcast=True, perm=plan.perm)
    two = reference_vc_attention(q, probe.k, probe.v, v_smooth=True, expcast=True, perm=plan.perm, v_terms=2)
    exp2_two = reference_vc_attention(q, probe.k, probe.v, v_smooth=True, expcast=False, perm=plan.perm, v_terms=2)
    lead = []
    for h in range(2):
        ck = sim.error_split(probe.q[0, h], qidx, probe.k[0, h], probe.v[0, h], plan.perm[0, h],
                             sim.SPLIT_CONFIGS["comfy_kitchen"], o_ref=o_ref[0, h])[1]["sqnr_db"]
        d, t, e = sqnr(default, h), sqnr(two, h), sqnr(exp2_two, h)
        # this probe: default 34.2 / 36.2, comfy-kitchen 41.3 / 41.6, two terms 48.1 / 42.7, with exp2 52.4 / 52.3
        assert t > d + 6.0 and t > ck + 0.5, (h, d, ck, t)
        assert e > t, (h, t, e)
        lead.append(t - ck)
    assert sum(lead) / 2 > 3.0, lead
