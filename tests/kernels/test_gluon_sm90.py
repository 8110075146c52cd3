"""The Hopper Gluon kernel, compiled here for sm_90 without a GPU (Gluon has no interpreter).

What can fail here: the kernel no longer builds with this Triton's Gluon API; its hot loop spills
registers (a measured 2-3x slowdown); it lost its TMA loads or its wgmma matmuls (INT8 Q K^T, FP8
P V, P times the ones tile for the row sum); the ExpCast build still converts floats to E4M3 or runs
the exp unit per score, or lost its copy of the loop without the clip at byte 120. Numerics are checked on
the H200 against the Triton twin and the reference (tests/gpu/test_gluon_sm90_gpu.py).
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")
ROOT = str(pathlib.Path(__file__).resolve().parents[2])

# A fresh process: under TRITON_INTERPRET=1 (the CPU suite) @gluon.jit makes interpreted functions.
COMPILE = textwrap.dedent("""
    import importlib.util, json, pathlib, sys
    root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    spec = importlib.util.spec_from_file_location("vc_attention", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec); sys.modules["vc_attention"] = mod; spec.loader.exec_module(mod)
    try:
        from vc_attention.kernels.gluon.launch_sm90 import compile_sm90, signature_and_constexprs
    except Exception as exc:
        print(json.dumps({"import_error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
    from vc_attention.kernels.gluon.config import pv_perm_for
    variants = {"expcast": dict(expcast=True), "expcast_bias": dict(expcast=True, has_bias=True),
                "plain_expcast_bias": dict(expcast=True, has_mean=False, has_bias=True),
                "exp2": dict(expcast=False), "plain_bias": dict(expcast=False, has_mean=False, has_bias=True),
                "plain_expcast": dict(expcast=True, has_mean=False),
                "mean_mma": dict(expcast=True, mean_mma=True),
                "fp32_mean": dict(expcast=True, mean_mma=False)}  # the twin's output bit for bit
    for kw in variants.values():  # the V^T column order dispatch uses with this Triton
        kw["pv_perm"] = pv_perm_for()
    variants["natural"] = dict(expcast=True, pv_perm=False)  # V^T in key order: P moves between lanes
    variants["wgmma_order"] = dict(expcast=True, pv_perm=True)  # P carried as words (flag_pack)
    variants["wgmma_order_tail"] = dict(expcast=True, pv_perm=True, expcast_tail=True)  # ExpCast's tail piece
    variants["exp2_words"] = dict(expcast=False, pv_perm=True)  # the exp2 path in wgmma order: ptx.e4m3_words
    variants["expcast_e4m3"] = dict(expcast=True, pv_perm=pv_perm_for(), p_e5m2=False)  # ExpCast's E4M3 bytes
    # V's residual in two E4M3 terms: as dispatch orders V^T on this Triton, and in wgmma order (mean_mma)
    variants["v_terms2"] = dict(expcast=True, pv_perm=pv_perm_for(), v_terms=2)
    variants["v_terms2_wgmma"] = dict(expcast=True, pv_perm=True, v_terms=2)
    # the dispatched ExpCast build in wgmma order without ptx_pass.py's rewrite
    variants["no_ptx_pass"] = dict(expcast=True, pv_perm=True, ptx_pass=False)
    mean_mma, shared = {}, {}
    for name, kw in variants.items():
        k = compile_sm90(**kw)
        shared[name] = k.metadata.shared
        (out / (name + ".ptx")).write_text(k.asm["ptx"])
        (out / (name + ".cubin")).write_bytes(k.asm["cubin"])
        build = {key: val for key, val in kw.items() if key != "ptx_pass"}
        mean_mma[name] = bool(signature_and_constexprs(**build)[1]["cfg"].schedule.mean_mma)
    print(json.dumps({"built": list(variants), "mean_mma": mean_mma, "shared": shared}))
""")


MEAN_MMA = "__mean_mma__"
SHARED = "__shared__"


def cuobjdump():
    path = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    pytest.importorskip("triton.backends.nvidia")
    out = tmp_path_factory.mktemp("gluon_sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", COMPILE, ROOT, str(out)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    if "import_error" in result:  # Triton without Gluon's Hopper API: say so loudly
        pytest.skip(f"SKIPPED LOUDLY: Triton {triton.__version__} cannot import the Gluon Hopper kernel: "
                    f"{result['import_error']}")
    builds = {}
    tool = cuobjdump()
    for name in result["built"]:
        sass = None
        if tool is not None:
            sass = subprocess.run([str(tool), "-sass", str(out / f"{name}.cubin")], capture_output=True,
                                  text=True, check=True).stdout
        builds[name] = ((out / f"{name}.ptx").read_text(), sass)
    builds[MEAN_MMA] = result["mean_mma"]  # which builds run mean_mma (and so the named ring)
    builds[SHARED] = result["shared"]  # bytes of shared memory per CTA
    return builds


BUILDS = ["expcast", "expcast_bias", "plain_expcast_bias", "exp2", "plain_bias", "plain_expcast", "expcast_e4m3"]
# P's byte format per build: ExpCast's default E5M2 (reference/expcast.py::P_E5M2_ON), E4M3 for exp2 +
# cast, for the tail piece and where asked (p_e5m2=False)
P_E4M3_BUILDS = {"exp2", "plain_bias", "exp2_words", "expcast_e4m3", "wgmma_order_tail"}


def test_p_byte_format_of_each_build(builds):
    """P.V and P.ones read P in the build's byte format (e5m2 x e4m3 or e4m3 x e4m3), and only in it."""
    for name, build in builds.items():
        if name in (MEAN_MMA, SHARED):
            continue
        ptx = build[0]
        p, other = ("e4m3", "e5m2") if name in P_E4M3_BUILDS else ("e5m2", "e4m3")
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.{p}\.e4m3", ptx), name
        assert not re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.{other}\.", ptx), name


@pytest.mark.parametrize("name", BUILDS)
def test_builds_with_tma_and_both_wgmma_matmuls(builds, name):
    ptx, _ = builds[name]
    p = "e4m3" if name in P_E4M3_BUILDS else "e5m2"
    assert "cp.async.bulk.tensor" in ptx  # K and V^T tiles by TMA
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8", ptx)  # INT8 Q K^T
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.{p}\.e4m3", ptx)  # FP8 P V
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.{p}\.e4m3", ptx)  # row sum: P ones
    # S_j waited while P_{j-1} V_{j-1} and P_{j-1} ones run (and, with mean_mma, the mean of tile j - 2)
    assert re.search(r"wgmma\.wait_group\.sync\.aligned [23];", ptx)


@pytest.mark.parametrize("name", BUILDS)
def test_warp_specialised(builds, name):
    """A producer warp and two consumer warpgroups: registers moved between them (setmaxnreg), the
    ring stages handed back by mbarrier arrives or (the named ring) by every consumer warp's bar.arrive on
    a named barrier of 2 x 128 + 32 threads, and no CTA-wide barrier in the loop (bar.sync 0)."""
    ptx, _ = builds[name]
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx and "setmaxnreg.dec.sync.aligned.u32" in ptx
    if builds[MEAN_MMA][name]:  # the builds with V-Smooth's mean on the tensor cores: the named ring
        assert re.search(r"bar\.arrive %r\d+, 288;", ptx) and re.search(r"bar\.sync %r\d+, 288;", ptx)
        assert "mbarrier.arrive.shared::cta.b64" not in ptx
    else:
        assert "mbarrier.arrive.shared::cta.b64" in ptx
    assert not re.search(r"\bbar(rier)?\.sync(\.aligned)?\s+0\s*;", ptx)


def sass_of(builds, name):
    """The SASS of one build; skips loudly where this Triton ships no cuobjdump to read it."""
    sass = builds[name][1]
    if sass is None:
        pytest.skip("SKIPPED LOUDLY: this Triton ships no cuobjdump to read the SASS")
    return sass


def hot_loops(sass):
    """The innermost loops that run wgmma (the key-tile loops: one per consumer warpgroup, and per
    copy of the consumer), each as its list of SASS lines."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i]:
            start = addr.index(int(m.group(1), 16)) if int(m.group(1), 16) in addr else None
            if start is not None:
                loops.append((start, i))
    inner = [(a, b) for a, b in loops if not any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2 in loops)]
    return [lines[a:b + 1] for a, b in inner if any("GMMA" in ln for ln in lines[a:b + 1])]


def tiles(body):
    """Key tiles per trip of a loop: one INT8 score matmul each (IGMMA, 4 k-steps of 32 at D = 128)."""
    return max(1, sum(bool(re.search(r"\bIGMMA\b", ln)) for ln in body) // 4)


def per_tile(body, pattern):
    return sum(bool(re.search(pattern, ln)) for ln in body) / tiles(body)


def clips_at_120(body):
    """ExpCast's clip at byte 120 in a loop: a float min against M + 120 = 12583032, or with the tail
    piece (softmax.tail_clip) an int32 min against its bits 0x4b400078."""
    return any(("FMNMX" in ln and "12583032" in ln) or ("VIMNMX" in ln and "0x4b400078" in ln.lower())
               for ln in body)


# Local-memory accesses (spills) inside the key-tile loops, per tile, for each build at its
# block_n_for tile width and with the V^T column order dispatch uses on that Triton (pv_perm_for:
# wgmma order on 3.6 and 3.8, key order on 3.9), on Triton 3.6 (the H200's) / 3.8 (ComfyUI's
# requirements) / 3.9. (In wgmma order Triton 3.9's expcast build makes 51 per tile, hence key order
# there.) The consumers have 240 registers (two warpgroups + the producer share 64K); a key bias adds
# its loads, plain 8-bit V promotes the FP8 accumulator every 32 keys. The bounds (the measured count
# of each Triton, or the largest of them for another release) keep the counts from growing unseen: a
# spill is a slowdown, never a wrong value. (ExpCast's E5M2 and E4M3 builds compile to the same instruction
# counts on 3.6 and 3.9.)
LOOP_SPILLS = {"expcast": (4, 0, 9), "expcast_e4m3": (4, 0, 9), "expcast_bias": (0, 0, 0), "plain_expcast_bias": (42, 20, 56),
               "exp2": (0, 0, 0), "plain_bias": (0, 0, 27), "plain_expcast": (7, 6, 1)}


TRITON_RELEASE = ".".join(triton.__version__.split(".")[:2])


def loop_spill_bound(name):
    measured = dict(zip(("3.6", "3.8", "3.9"), LOOP_SPILLS[name]))
    return measured.get(TRITON_RELEASE, max(LOOP_SPILLS[name]))


def test_wgmma_column_order_makes_the_p_operand_a_register_renaming(builds):
    """With V^T's columns in wgmma order (pv_perm=True, pipeline.pv_key) P's bytes reach the P.V
    wgmma from the registers the score accumulator left them in: no SHFL.IDX / SEL lane exchange in
    the key-tile loop (the row max's SHFL.BFLY stays). In key order Triton moves P between lanes
    (24 SHFL.IDX + 16 SEL per 128-key tile on Triton 3.6; ~25% of the loop's stall samples on the
    H200, ncu). Also: ptxas keeps every wgmma asynchronous in both (the masked tail step waits for
    P.V before its softmax; without that, ptxas serialised every wgmma of the kernel)."""
    for name, want_shuffles in (("wgmma_order", False), ("natural", True)):
        sass = sass_of(builds, name)
        loops = hot_loops(sass)
        assert len(loops) >= 2
        for body in loops:
            shuffles = per_tile(body, r"\bSHFL\.IDX\b")
            assert (shuffles > 0) == want_shuffles, f"{name}: {shuffles} SHFL.IDX per tile"
            waits, gmma = per_tile(body, "WARPGROUP.DEPBAR"), per_tile(body, "GMMA")
            assert waits <= 3 and gmma >= 12, f"{name}: {waits} waits for {gmma} wgmma per tile"


@pytest.mark.parametrize("name", BUILDS)
def test_register_spills_in_the_hot_loop(builds, name):
    sass = sass_of(builds, name)
    assert "IGMMA" in sass and "QGMMA" in sass and "UTMALDG" in sass
    loops = hot_loops(sass)
    assert len(loops) >= 2, "no key-tile loop found"  # one per consumer warpgroup
    worst = max(per_tile(body, r"\b(STL|LDL)\b") for body in loops)
    assert worst <= loop_spill_bound(name), f"{worst} local-memory accesses per tile"


def test_expcast_has_a_loop_without_the_clip_at_120(builds):
    """The default build carries two copies of the key-tile loop: with ExpCast's clip at byte 120
    (clips_at_120) and without it (taken where _no_clip_flags proves it idle);
    the copy without it is shorter by about one instruction per score."""
    sass = sass_of(builds, "expcast")
    def clips(body):
        return clips_at_120(body)

    clip = [body for body in hot_loops(sass) if clips(body)]
    free = [body for body in hot_loops(sass) if not clips(body)]
    assert clip and free
    assert max(len(b) / tiles(b) for b in free) < min(len(b) / tiles(b) for b in clip)


def test_expcast_writes_bytes_without_the_exp_unit(builds):
    """ExpCast: no float->E4M3 conversion, and exp2 only for the per-row rescale (not per score)."""
    ptx_ec, _ = builds["expcast"]
    ptx_e2, _ = builds["exp2"]
    assert "cvt.rn.satfinite.e4m3x2.f32" not in ptx_ec
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx_e2
    n_ec, n_e2 = ptx_ec.count("ex2.approx"), ptx_e2.count("ex2.approx")
    assert n_e2 >= 8 * n_ec > 0, (n_ec, n_e2)


def test_host_path_hands_the_kernel_the_triton_pre_pass(monkeypatch):
    """gluon_vc_attention (the backend "gluon" path) runs the library's pre-pass and passes its
    operands on unchanged: with the Triton twin standing in for the Gluon launch (Gluon cannot run
    on a CPU), the result is bit-identical to the Triton path with the same key tiles."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("runs the Triton pre-pass through TRITON_INTERPRET=1 (CPU)")
    import torch

    try:
        from vc_attention.kernels.gluon import config, gluon_vc_attention, launch_sm90
    except Exception as exc:
        pytest.skip(f"SKIPPED LOUDLY: the Gluon Hopper kernel cannot be imported here: {exc}")
    from vc_attention.kernels.pipeline import vc_attention_fwd
    from vc_attention.kernels.triton.attention import triton_vc_attention
    from vc_attention.kernels.triton.launch import triton_launch

    seen = {}

    def twin(*args, **kwargs):
        seen["kwargs"] = kwargs
        return vc_attention_fwd(triton_launch, *args, **kwargs, block_n=block_n)

    block_n = config.block_n_for(has_mean=True, has_bias=True, expcast=True)

    monkeypatch.setattr(launch_sm90, "vc_attention_fwd_sm90", twin)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    perm = torch.stack([torch.randperm(200, generator=g) for _ in range(2)])[None]
    bias = torch.zeros(1, 1, 1, 200)
    bias[..., 150:] = float("-inf")
    got, want = torch.empty_like(q), torch.empty_like(q)
    gluon_vc_attention(q, k, v, got, perm=perm, key_bias=bias)
    triton_vc_attention(q, k, v, want, perm=perm, key_bias=bias, block_n=block_n)
    assert seen["kwargs"]["key_bias_log2"] is not None and seen["kwargs"]["expcast"] is True
    assert torch.equal(got, want)


def test_launch_arguments(monkeypatch):
    """The host function (run up to the launch, which needs a GPU): TMA descriptors over the
    pre-pass buffers with the kernel's tile shapes, the grid, the bias strides and the constexprs."""
    import torch

    try:
        from vc_attention.kernels.gluon import config
        from vc_attention.kernels.gluon import launch_sm90 as G
    except Exception as exc:
        pytest.skip(f"SKIPPED LOUDLY: the Gluon Hopper kernel cannot be imported here: {exc}")
    from vc_attention.kernels.pipeline import prepare_8bit
    from vc_attention.kernels.reference.expcast import EXPCAST_BETA_E5M2
    from vc_attention.kernels.triton.launch import triton_launch

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("runs the Triton pre-pass through TRITON_INTERPRET=1 (CPU)")
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))

    monkeypatch.setattr(G, "vc_attention_fwd_sm90_kernel", Recorder())
    B, H, M, N, D = 2, 3, 300, 333, 128
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, M, D, generator=g)
    k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(2))
    bias = torch.zeros(B, 1, 1, N)
    out = torch.empty(B, H, M, D)
    for key_bias in (bias, None):
        calls.clear()
        ops, bias_log2 = prepare_8bit(triton_launch, q, k, v, key_bias=key_bias)
        G.vc_attention_fwd_sm90(*ops, out, H, key_bias_log2=bias_log2)
        (grid, args, kw), = calls
        block_n = 64 if key_bias is not None else 128  # block_n_for: V-Smooth + ExpCast, with / without bias
        cfg = kw["cfg"]
        assert cfg.tiles.block_n == block_n == config.block_n_for(True, key_bias is not None, True)
        assert grid == (3, B * H)  # ceil(300 / 128) query blocks x (batch, head)
        q_desc, k_desc, vt_desc, vlo_desc, mu_desc, ones_desc = args[:6]
        assert vlo_desc is None  # V in one E4M3 term (v_terms=1)
        assert q_desc.block_shape == [128, D] and q_desc.shape == [B * H * M, D]
        assert k_desc.block_shape == [block_n, D] and k_desc.shape == [B * H * N, D]
        assert vt_desc.block_shape == [D, block_n] and vt_desc.shape == [B * H * D, 384]  # N padded to 128
        assert mu_desc.block_shape == [1, D] and mu_desc.shape == [B * H * 3, D]  # one mean row per 128 keys
        assert torch.equal(mu_desc.base.reshape(B * H, 3, D), ops[6]["mu_scaled"])
        assert ones_desc.block_shape == [8, block_n] and ones_desc.base.float().eq(1).all()
        assert args[6] is ops[1] and args[8] is ops[4]  # the Q and K block scales
        noclip = args[11]  # per (batch, head): the clip at byte 120 provably idle (unit-scale inputs: yes)
        assert noclip.dtype == torch.int8 and noclip.shape == (B * H,)
        assert noclip.tolist() == ([0] * (B * H) if key_bias is not None else [1] * (B * H))
        assert args[12] is bias_log2
        if key_bias is not None:
            assert args[13:15] == (H * N, N)  # the pre-pass expands the bias to [B, H, N]
        assert args[15] is out and args[16:20] == out.stride()
        assert args[20:23] == (H, M, N)
        n = cfg.numerics
        assert n.has_mean and n.has_bias == (key_bias is not None) and n.expcast and n.p_e5m2
        assert n.beta == EXPCAST_BETA_E5M2 and n.codes == 4.0 and n.p_carry == 15.0
        assert n.pv_imprecise_acc == block_n
        assert cfg.tiles.stages == config.STAGES and kw["num_warps"] == cfg.tiles.num_warps == config.NUM_WARPS
        # key order (no pv_perm asked of the pre-pass): the mean in fp32 from its [1, D] rows
        assert not cfg.schedule.pv_perm and not cfg.schedule.mean_mma
    # V's second term (pre-pass v_terms=2): its descriptor is V^T's twin, and the build is v_terms=2
    calls.clear()
    ops, _ = prepare_8bit(triton_launch, q, k, v, v_terms=2)
    G.vc_attention_fwd_sm90(*ops, out, H)
    (grid, args, kw), = calls
    assert kw["cfg"].numerics.v_terms == 2
    vt_desc, vlo_desc = args[2], args[3]
    assert vlo_desc.block_shape == vt_desc.block_shape and vlo_desc.shape == vt_desc.shape
    assert vlo_desc.base.data_ptr() == ops[6]["vt_lo"].data_ptr()
    # the kernel takes INT8 codes only: E4M3 Q / K is refused, not run
    calls.clear()
    ops, _ = prepare_8bit(triton_launch, q, k, v, qk_format="fp8")
    with pytest.raises(ValueError, match="INT8"):
        G.vc_attention_fwd_sm90(*ops, out, H)
    assert not calls


def test_build_choice():
    """config.build_for: the dispatched build per option, and a clear error for a mean_mma build that
    cannot run (plain V, or key tiles narrower than a V-Smooth block)."""
    try:
        from vc_attention.kernels.gluon import config
    except Exception as exc:
        pytest.skip(f"SKIPPED LOUDLY: the Gluon Hopper kernel cannot be imported here: {exc}")
    b = config.build_for(pv_perm=True)
    assert b.tiles.block_n == 128 and b.schedule.mean_mma and b.schedule.flag_pack and b.schedule.named_ring
    assert not config.build_for(pv_perm=False).schedule.mean_mma  # key order: the fp32 mean
    assert not config.build_for(pv_perm=True, has_bias=True).schedule.mean_mma
    assert not config.build_for(pv_perm=True, expcast=False).schedule.mean_mma
    assert config.build_for(pv_perm=True, has_bias=True).tiles.block_n == 64
    assert config.build_for(has_mean=False).numerics.pv_imprecise_acc == 32
    assert config.build_for(pv_perm=False, mean_mma=True).schedule.mean_mma  # an option in key order too
    with pytest.raises(ValueError, match="mean_mma"):
        config.build_for(has_mean=False, mean_mma=True)
    with pytest.raises(ValueError, match="mean_mma"):
        config.build_for(block_n=64, mean_mma=True)
    assert [config.pv_perm_for(v) for v in ("3.6.0", "3.8.0", "3.9.0", "3.10.0")] == [True, True, False, False]


def test_no_clip_flags_bound():
    """no_clip_flags: 1 exactly where 8 x qs ks stays below 2^21 for every |x| <= 127^2 D and
    c8 = 8 qs ks < 1/4 (the fold's condition, the tighter one); 0 with a key bias, with NaN or inf
    scales, or past the bound."""
    import torch

    try:
        from vc_attention.kernels.gluon import launch_sm90 as G
    except Exception as exc:
        pytest.skip(f"SKIPPED LOUDLY: the Gluon Hopper kernel cannot be imported here: {exc}")
    D = 128
    # INT8: the fold of the int32 -> fp32 conversion (expcast_fold) binds first: c8 = 8 qs ks < 1/4
    edge = (0.25 / 8) ** 0.5  # qs = ks = edge puts c8 at 1/4 (and 8 x qs ks at 127^2 D / 4 < 2^21)
    qs = torch.tensor([[edge * 0.99, 1e-3], [edge * 1.01, 1e-3], [float("nan"), 1.0], [float("inf"), 1.0]])
    ks = torch.tensor([[edge, 1e-3], [edge, 1e-3], [1e-3, 1e-3], [1e-3, 1e-3]])
    assert G.no_clip_flags(qs, ks, D, False).tolist() == [1, 0, 0, 0]
    assert G.no_clip_flags(qs, ks, D, True).tolist() == [0, 0, 0, 0]
    # where c8 < 1/4 holds, the 2^21 bound on 8 x qs ks binds at a larger head dim
    D2 = 4096
    edge2 = (2.0 ** 21 / (8 * 127.0 ** 2 * D2)) ** 0.5
    qs2, ks2 = torch.tensor([[edge2 * 0.99], [edge2 * 1.01]]), torch.tensor([[edge2], [edge2]])
    assert (8 * qs2 * ks2).max().item() < 0.25
    assert G.no_clip_flags(qs2, ks2, D2, False).tolist() == [1, 0]


def _kernel_bytes(x, c8, beta=-0.35, clip_hi=True):
    """The Hopper kernel's ExpCast arithmetic on one tile, rounding for rounding (fp32 where the
    kernel is fp32; its FFMA as the exact float64 value rounded once to fp32): the byte as an integer.
    x: [rows, keys] float32 holding the integer Q.K accumulator; c8: 8 x the tile's scale (fp32)."""
    import torch

    M = 12582912.0
    c8 = torch.tensor(c8, dtype=torch.float32)
    m = x.max(dim=1).values
    k = torch.ceil((8.0 * (m * (c8 * 0.125))) - torch.tensor(beta, dtype=torch.float32))  # fp32 ops
    addend = (torch.tensor(M + 120.0, dtype=torch.float32) - k)[:, None]
    t = (x.double() * c8.double() + addend.double()).float()  # one rounding: the FFMA
    t = torch.maximum(t, torch.tensor(M))
    if clip_hi:
        t = torch.minimum(t, torch.tensor(M + 120.0))
    return (t.double() - M).long()


def test_the_clip_at_120_is_idle_wherever_no_clip_flags_allows_it():
    """The claim behind the kernel's copy without the clip: for every INT8 accumulator |x| <= 127^2 D
    and every scale with 8 x 127^2 D qs ks < 2^21 (_no_clip_flags' bound), the byte without the clip
    at 120 is the byte with it. Far past the bound the clip does bind (the test can fail)."""
    import torch

    D = 128
    xmax = 127.0 ** 2 * D
    g = torch.Generator().manual_seed(0)
    c8_edge = 2.0 ** 21 / xmax  # 8 qs ks at the flag's bound
    for c8 in [c8_edge * f for f in (1e-4, 0.013, 0.31, 0.5, 0.77, 0.999)]:
        rand = torch.randint(-int(xmax), int(xmax) + 1, (64, 128), generator=g).float()
        edge = torch.tensor([[xmax, xmax - 1, -xmax, 0.0], [xmax - 3, xmax - 2, xmax - 5, xmax - 7],
                             [-xmax, -xmax + 1, -xmax + 2, -xmax]])
        for x in (rand, edge, rand / 1024.0, torch.round(rand / 1024.0)):
            x = torch.round(x)
            free, clipped = _kernel_bytes(x, c8, clip_hi=False), _kernel_bytes(x, c8)
            assert free.max().item() <= 120 and free.min().item() >= 0
            assert torch.equal(free, clipped)
            # and every row's max lands on byte 119 or 120 (the grid-snapped reference point)
            assert set(free.max(dim=1).values.tolist()) <= {119, 120}
    # Eight times past the bound (|8 s| ~ 2^24) the rounding of the row max in k lets bytes pass 120
    # (measured: 121 from 8 qs ks ~ 8.4, 136 at 100): there the clip is needed.
    x = torch.round(torch.rand(256, 128, generator=g) * xmax)
    worst = max(_kernel_bytes(x, c, clip_hi=False).max().item() for c in (8.4, 10.25, 100.3))
    assert worst > 120
    assert _kernel_bytes(x, 100.3).max().item() == 120


def test_expcast_folds_the_int32_conversion_into_the_byte_fma(builds):
    """In the copy without the clip at 120 (whose scales prove c8 < 1/4) the INT8 dot's bits plus those
    of 1.5 * 2^23 go straight into ExpCast's FFMA (kernels/triton/online.py::expcast_fold): no float
    subtract per score left in that loop (a dozen FADD per tile for the row statistics), where the
    clipped copy keeps one per score (64 per thread per 128-key tile)."""
    sass = sass_of(builds, "expcast")

    def clips(body):
        return clips_at_120(body)

    def fadds(body):
        return sum(bool(re.search(r"\bFADD\b", ln)) for ln in body)

    loops = hot_loops(sass)
    free = [fadds(b) / tiles(b) for b in loops if not clips(b)]
    clip = [fadds(b) / tiles(b) for b in loops if clips(b)]
    assert free and clip and max(free) <= 16 and min(clip) >= 64, (free, clip)


def test_flag_pack_build_packs_bytes_without_the_clip_at_zero(builds):
    """In wgmma order P is carried as words (flag_pack): without ExpCast's tail piece the no-clip loop
    (the default) packs P by PRMT, the byte's sign bit read from the FFMA result's exponent (0xFEBA selector,
    ptx.flag_pack_words), with no FMNMX against 1.5 * 2^23 (the clip at 0) left in it; every wgmma
    stays asynchronous."""
    sass = sass_of(builds, "wgmma_order")
    loops = hot_loops(sass)
    free = [b for b in loops if not any("FMNMX" in ln and ("0x4b400000" in ln or "12582912" in ln) for ln in b)]
    assert free and any(any("PRMT" in ln and "0xfeba" in ln.lower() for ln in b) for b in free)
    for body in loops:
        n_mma, n_wait = per_tile(body, "GMMA"), per_tile(body, "WARPGROUP.DEPBAR")
        assert n_mma >= 8 and n_wait <= 3, (n_mma, n_wait)


def test_tail_piece_costs_an_ffma_and_two_integer_max_per_score(builds):
    """ExpCast's tail piece (softmax.tail_clip): every hot loop of the default wgmma-order build has
    its FFMA by A = 3/16 (0x3e400000) on the byte's FFMA result, 64 a tile per thread (one per score),
    and no loop of the build without it has one. The no-clip loop then takes the max with the piece
    and the clip at 0 on int32 (VIMNMX) and packs the low bytes (flag_pack_words needs the 2^23 magic,
    whose codes below 0 are half-integers). What it adds per tile and thread: at most three
    instructions per score (Triton 3.8: 2.5, 430 -> 590 in the no-clip loop); all wgmma stay
    asynchronous."""
    def a_ffma(body):  # the piece's addend M (1 - A) + B = 10223620 (A sits in a register)
        return sum(bool(re.search(r"\bFFMA\b", ln)) and "10223620" in ln for ln in body)

    tail = hot_loops(sass_of(builds, "wgmma_order_tail"))
    plain = hot_loops(sass_of(builds, "wgmma_order"))
    assert tail and plain
    assert all(a_ffma(b) / tiles(b) == 64 for b in tail), [a_ffma(b) / tiles(b) for b in tail]
    assert not any(a_ffma(b) for b in plain)
    assert not any(any("PRMT" in ln and "0xfeba" in ln.lower() for ln in b) for b in tail)
    per = lambda b: len(b) / tiles(b)  # noqa: E731
    extra = max(per(b) for b in tail) - max(per(b) for b in plain)
    assert 0 < extra <= 64 * 3, extra
    for body in tail:
        assert per_tile(body, "GMMA") >= 8 and per_tile(body, "WARPGROUP.DEPBAR") <= 3


def test_exp2_build_carries_p_as_words_of_the_conversion(builds):
    """The exp2 path in wgmma order: P's bytes come from cvt.rn.satfinite.e4m3x2.f32 (F2FP, two
    scores each, the conversion `.to(gl.float8e4nv)` makes) straight into the 32-bit words the P.V
    operand reads (ptx.e4m3_words), so the loop has no byte shuffling left (carried as bytes, Triton
    unpacked the conversion's byte pairs and repacked them: per 128-key tile 110 PRMT, 64 LOP3, 32 SHF
    on Triton 3.6)."""
    sass = sass_of(builds, "exp2_words")
    from vc_attention.kernels.gluon.config import pv_perm_for

    loops = hot_loops(sass)
    assert loops
    for body in loops:
        assert per_tile(body, r"\bF2FP\b") == 32, per_tile(body, r"\bF2FP\b")  # 64 scores a thread
        shuffles = per_tile(body, r"\b(PRMT|LOP3|SHF)\b")
        assert shuffles <= 8, shuffles
        # where dispatch takes the wgmma order (3.6, 3.8) this build is the exp2 path's, without spills
        # (Triton 3.9, in key order, spills 53 a tile in this order, as its ExpCast build does)
        if pv_perm_for():
            assert per_tile(body, r"\b(STL|LDL)\b") <= loop_spill_bound("exp2")


def test_exp2_build_takes_the_row_max_on_the_int32_dot(builds):
    """The exp2 path in wgmma order, full tiles without a key bias: the row max is taken on the INT8
    dot's int32 accumulator by the VIMNMX3 tree (softmax.row_max) and scaled once, the same value as
    the max of x = dot * scale (the product rounds monotonically), instead of a multiply and a
    chained FMNMX per score (65 FMUL and 74 FMNMX per 128-key tile without it)."""
    sass = sass_of(builds, "exp2_words")
    loops = hot_loops(sass)
    # the full-tile loop(s): the masked last tile runs outside them
    assert loops and all(per_tile(body, r"\bMUFU\b") >= 64 for body in loops)
    for body in loops:
        assert per_tile(body, r"\bVIMNMX3\b") >= 16, per_tile(body, r"\bVIMNMX3\b")
        assert per_tile(body, r"\bFMUL\b") <= 8 and per_tile(body, r"\bFMNMX\b") <= 16, (
            per_tile(body, r"\bFMUL\b"), per_tile(body, r"\bFMNMX\b"))


def test_mean_mma_build_adds_the_mean_on_the_tensor_cores(builds):
    """mean_mma=True (dispatched in wgmma order): V-Smooth's mean goes into P.V's accumulator by a
    tf32 wgmma (HGMMA.64x128x8.F32.TF32) chained to P.V, a tile late, instead of shared loads and
    FFMAs: no LDS in the key-tile loops, and no wait of its own: two waits per tile, S, then P.V +
    the mean + P.ones."""
    sass = sass_of(builds, "mean_mma")
    for body in hot_loops(sass):
        assert any("HGMMA.64x128x8.F32.TF32" in ln for ln in body)
        assert not any(re.search(r"\bLDS\b", ln) for ln in body)
        assert per_tile(body, "WARPGROUP.DEPBAR") <= 2


def test_wgmma_order_loop_takes_the_row_max_on_int32(builds):
    """The wgmma-order build as dispatched: in the copy without the clip at 120 the row max is taken
    on the INT8 dot's int32 accumulator, where ptxas fuses pairs of max.s32 into VIMNMX3 (about 31
    per tile, at most a few FMNMX left for the running max), with every wgmma still asynchronous (no
    C7513 serialisation), one key tile per loop trip."""
    sass = sass_of(builds, "wgmma_order")
    free = [b for b in hot_loops(sass) if not clips_at_120(b)]
    assert free and all(tiles(b) == 1 for b in free), [tiles(b) for b in free]
    for body in free:
        assert per_tile(body, r"\bVIMNMX3\b") >= 28 and per_tile(body, r"\bFMNMX\b") <= 4
        assert per_tile(body, "WARPGROUP.DEPBAR") <= 2 and per_tile(body, "GMMA") >= 12


@pytest.mark.parametrize("name", BUILDS)
def test_wgmma_stays_asynchronous_in_the_hot_loop(builds, name):
    """ptxas serialises wgmma (a wait for zero groups after every instruction) when it cannot prove an
    in-flight accumulator's registers safe; measured here when the score matmul's asynchronous
    accumulator was carried across loop iterations (S_{j+1} issued before the softmax of tile j: every
    wgmma of the loop followed by WARPGROUP.DEPBAR.LE gsb0, 0x0). Each build issues its loop's wgmma
    back to back and waits at most three times per tile. Plain 8-bit V is the known exception: its
    FP8 accumulator is promoted to fp32 every 32 keys (kernels/triton/attention.py says why), and
    Triton waits for each 32-key piece before adding it, so those builds wait once per wgmma (8 per
    64-key tile)."""
    sass = sass_of(builds, name)
    max_waits = 8 if name.startswith("plain") else 3
    for body in hot_loops(sass):
        n_mma, n_wait = per_tile(body, "GMMA"), per_tile(body, "WARPGROUP.DEPBAR")
        assert n_mma >= 8 and n_wait <= max_waits, (n_mma, n_wait)


def test_named_ring_loops_have_no_warpgroup_barrier(builds):
    """The named ring and ptx_pass: in the builds with V-Smooth's mean on the tensor cores, a consumer
    warp hands each ring stage back by its own bar.arrive on a named barrier of 288 threads (BAR.ARV
    R, 0x120) and waits for the next tile's TMA by polling the mbarrier itself: no warpgroup barrier
    (BAR.SYNC over 128 threads) is left in the key-tile loops. Gluon's partition-level
    mbarrier.arrive puts one before each arrival and Triton one before each mbarrier wait: two per
    tile."""
    ring = [n for n, on in builds[MEAN_MMA].items() if on and n != "no_ptx_pass"]
    if not ring:
        pytest.skip("SKIPPED LOUDLY: no build of this Triton runs mean_mma")
    for name in ring:
        sass = sass_of(builds, name)
        loops = hot_loops(sass)
        assert loops, name
        for body in loops:
            assert not any(re.search(r"BAR\.SYNC\S*\s+(0x)?\w+,\s*0x80\b", ln) for ln in body), name
            assert per_tile(body, r"BAR\.ARV\s+R\d+,\s*0x120\b") == 1, name


def test_expcast_loop_holds_the_pv_wait_after_the_bytes(builds):
    """hold_pv_wait: without it ptxas waits for P.V right after the wait for S_j (it schedules O's
    fold first), so the softmax never overlaps P.V; the CTA fence in front of the wait keeps the row
    max, the reference point and the bytes' 64 FFMA between the two waits. In the dispatched ExpCast
    build (one key tile per trip, the mean on the tensor cores), in every copy of the loop: MEMBAR
    right before the wait for everything, at least 64 FFMA after the wait for S_j."""
    if not builds[MEAN_MMA]["expcast"]:
        pytest.skip("SKIPPED LOUDLY: the dispatched ExpCast build of this Triton does not run mean_mma")
    sass = sass_of(builds, "expcast")
    loops = hot_loops(sass)
    assert loops
    for body in loops:
        assert tiles(body) == 1
        waits = [i for i, ln in enumerate(body) if "WARPGROUP.DEPBAR.LE" in ln]
        assert len(waits) == 2 and "gsb0, 0x0" in body[waits[1]], [body[i] for i in waits]
        assert any("MEMBAR" in ln for ln in body[waits[1] - 3:waits[1]])
        between = body[waits[0]:waits[1]]
        assert sum(bool(re.search(r"\bFFMA\b", ln)) for ln in between) >= 64


def test_ptx_pass_drops_only_the_barrier_before_a_consumer_wait():
    """ptx_pass: in PTX carrying the named-ring mark, a 128-thread bar.sync right before an mbarrier
    try_wait loop (as Triton emits it) goes; any other barrier stays, and PTX without the mark is
    returned unchanged."""
    from vc_attention.kernels.gluon.ptx_pass import RING_MARK, ptx_pass

    wait = ("\tbar.sync \t2, 128;\n\t// begin inline asm\n\t\n{\n\t.reg .pred complete;\n\twaitLoop:\n"
            "\tmbarrier.try_wait.parity.shared.b64 complete, [%r9], %r10;\n\t@!complete bra.uni waitLoop;\n}\n")
    other = "\tbar.sync \t2, 128;\n\tst.shared.b32 [%r1], %r2;\n"
    ptx = f"// begin inline asm\n{RING_MARK}\n bar.arrive %r3, 288;\n" + wait + other
    out = ptx_pass(ptx)
    assert out.count("bar.sync") == 1 and other in out and "mbarrier.try_wait" in out
    assert ptx_pass(ptx.replace(RING_MARK, "// another kernel")) == ptx.replace(RING_MARK, "// another kernel")


def test_ptx_pass_hook_chains_and_restores():
    """ptx_pass_installed sets Triton's stage hook for the block only, after any hook already there,
    and (Triton 3.8+ ask it with no arguments) adds its own name to the pipeline's cache key."""
    from triton import knobs
    from vc_attention.kernels.gluon.ptx_pass import ptx_pass_installed

    seen = []

    def theirs(*args):
        if not args:
            return "theirs", "h"
        seen.append(args[1]["ptx"])

    before = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = theirs
    try:
        with ptx_pass_installed():
            hook = knobs.runtime.add_stages_inspection_hook
            key, digest = hook()
            assert key.startswith("theirs") and "vc-attention" in key and digest.startswith("h")
            stages = {"ptx": lambda src, metadata: src}
            hook(None, stages, None, None, 90)
            assert len(seen) == 1 and stages["ptx"]("plain ptx", {}) == "plain ptx"
        assert knobs.runtime.add_stages_inspection_hook is theirs
    finally:
        knobs.runtime.add_stages_inspection_hook = before


def test_ptx_pass_removes_the_loops_warpgroup_barriers(builds):
    """The rewrite is what takes the last warpgroup barrier out of the named-ring loop: the same build
    compiled without ptx_pass (as on a Triton without the stage hook) keeps a BAR.SYNC over 128
    threads in every copy of its key-tile loop, and its PTX a bar.sync before a consumer's wait."""
    if not builds[MEAN_MMA]["no_ptx_pass"]:
        pytest.skip("SKIPPED LOUDLY: the wgmma-order ExpCast build of this Triton does not run mean_mma")
    ptx, sass = builds["no_ptx_pass"]
    ptx_on, _ = builds["wgmma_order"]
    bar_wait = r"bar\.sync \t\d+, 128;\n(?:[^\n]*\n){0,8}?[ \t]*mbarrier\.try_wait"
    assert re.search(bar_wait, ptx) and not re.search(bar_wait, ptx_on)
    if sass is None:
        pytest.skip("SKIPPED LOUDLY: this Triton ships no cuobjdump to read the SASS")
    loops = hot_loops(sass)
    assert loops
    for body in loops:
        assert any(re.search(r"BAR\.SYNC\S*\s+(0x)?\w+,\s*0x80\b", ln) for ln in body)


HOPPER_SHARED_PER_CTA = 232_448  # 227 KB: the most an sm_90 CTA may opt into
# What V's second term adds to a key-tile loop, per tile: (local-memory accesses, instructions), as
# measured per Triton release (both V^T orders): none and 15 on 3.6 (the H200's) and 3.8; 3.9 spills
# (8 -> 46-52 in key order, 66 -> 98 in wgmma order) and adds 64-67 instructions.
V_TERMS2_GROWTH = {"3.6": (0, 20), "3.8": (0, 20), "3.9": (50, 75)}


@pytest.mark.parametrize("name,base", [("v_terms2", "expcast"), ("v_terms2_wgmma", "wgmma_order")])
def test_v_second_term_is_one_more_fp8_product_per_tile(builds, name, base):
    """V's residual in two E4M3 terms (v_terms=2): per key tile the loop issues the FP8 P.V product
    twice (4 more QGMMA k-steps, the second chained onto the first's accumulator on the tensor cores)
    with no more waits (a bound on its imprecise sums would have Triton add a partial accumulator on
    the CUDA cores, and ptxas serialise every wgmma), and the loop grows by no more than
    V_TERMS2_GROWTH says for this Triton; its ring of 4 stages fits a CTA's shared memory."""
    assert builds[SHARED][name] <= HOPPER_SHARED_PER_CTA, builds[SHARED][name]
    extra = builds[SHARED][name] - builds[SHARED][base]
    assert 4 * 128 * 128 <= extra <= 4 * 128 * 128 + 1024, extra  # one [D, 128] E4M3 tile a stage, aligned
    two, one = hot_loops(sass_of(builds, name)), hot_loops(sass_of(builds, base))
    assert len(two) == len(one) >= 2
    for b2, b1 in zip(two, one):
        assert per_tile(b2, r"\bQGMMA\b") == per_tile(b1, r"\bQGMMA\b") + 4
        assert per_tile(b2, "WARPGROUP.DEPBAR") <= per_tile(b1, "WARPGROUP.DEPBAR")
        spills, instructions = V_TERMS2_GROWTH.get(TRITON_RELEASE, max(V_TERMS2_GROWTH.values()))
        assert per_tile(b2, r"\b(STL|LDL)\b") <= per_tile(b1, r"\b(STL|LDL)\b") + spills
        assert len(b2) / tiles(b2) <= len(b1) / tiles(b1) + instructions
