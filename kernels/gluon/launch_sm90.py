"""Host side of the Hopper kernel: the build a launch runs, TMA descriptors over the pre-pass's
buffers, the per-(batch, head) no-clip flags, the launch, and an ahead-of-time compile for CI.

vc_attention_fwd_sm90 takes the operands kernels/pipeline.py prepares (the arguments of
pipeline.vc_attention_fwd) and writes `out` in place. Every launch and compile_sm90 run with
ptx_pass.py's rewrite installed.
"""

from triton.experimental.gluon import language as gl

from .attention_sm90 import vc_attention_fwd_sm90_kernel
from .config import STAGES, build_for, mean_on_tensor_cores
from .ptx_pass import ptx_pass_installed


def _layouts(block_m, block_n, head_dim):
    """Shared-memory layouts of the three TMA tiles (Q [block_m, D], K [block_n, D], V^T [D, block_n])."""
    return (gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gl.int8),
            gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl.int8),
            gl.NVMMASharedLayout.get_default_for([head_dim, block_n], gl.float8e4nv))


def _mu_layout(mean_mma=False):
    """The [1, D] fp32 mean row: no swizzle (it is read as one row); mean_mma's [D, 8] tf32 B tile
    (K-major, 32-byte rows)."""
    if mean_mma:
        return gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _mu_block(head_dim, mean_mma=False):
    """The mean's TMA block: one row [1, D], or (mean_mma) [D, 8], the tf32 terms of a block and of the
    block before (pipeline.mu_tf32_pairs)."""
    return [head_dim, 8] if mean_mma else [1, head_dim]


def _ones_layout(block_n):
    """The [8, block_n] ones tile (B operand of the row-sum wgmma, K-major like V^T)."""
    return gl.NVMMASharedLayout.get_default_for([8, block_n], gl.float8e4nv)


_ONES = {}


def _ones_desc(device, block_n):
    """TMA descriptor of an [8, block_n] E4M3 tile of ones in global memory (one per device and width)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    key = (str(device), block_n)
    if key not in _ONES:
        ones = torch.ones(8, block_n, device=device).to(torch.float8_e4m3fn)
        _ONES[key] = (ones, TensorDescriptor(ones, [8, block_n], [block_n, 1], [8, block_n], _ones_layout(block_n)))
    return _ONES[key][1]


CODE_MAX = 127.0  # largest |code| of INT8 Q / K: |Q.K| <= 127^2 D


def no_clip_flags(q_scales, k_scales, head_dim, has_bias, codes=8.0):
    """Per (batch, head): 1 where ExpCast's clip at byte 120 provably never binds, on the device (no
    host sync). The byte is round(8 s - k + 120) with k = ceil(8 max s - beta) >= 8 s - beta - ulp(8 s),
    so it stays <= 120 while ulp(8 s) < 0.85, i.e. |8 s| < 2^23; and the FFMA's addend M + 120 - k is
    exact while |k| < 2^22. Here |8 s| <= 8 |x| qs ks with |x| <= 127^2 D: we ask < 2^21. That copy
    also folds the int32 -> fp32 conversion into the byte's FMA for every tile (softmax.scores'
    FOLD_ALL), which needs c8 = 8 qs ks < 1/4 (kernels/triton/online.py::expcast_fold): asked too, in
    fp32 as the kernel forms c8 (the largest product is that of the largest scales). A key bias (any
    value) keeps the clip; NaN or inf scales give 0 (the clipped loop). codes: ExpCast's codes per
    octave (E5M2 bytes: 4, with 4 s and c = 4 qs ks in place of 8 s and c8; its beta of -0.25 keeps
    the row maximum's byte <= 120 under the same bounds: reference/expcast.py)."""
    import torch

    if has_bias:
        return torch.zeros(q_scales.shape[0], dtype=torch.int8, device=q_scales.device)
    c8_max = codes * (q_scales.amax(dim=1) * k_scales.amax(dim=1))
    ok = (c8_max * (CODE_MAX ** 2 * head_dim) < 2.0 ** 21) & (c8_max < 0.25)
    return ok.to(torch.int8)


def signature_and_constexprs(*, head_dim=128, has_mean=True, has_bias=False, out_dtype="bf16", pv_perm=False,
                             **options):
    """Kernel signature and constexprs for an ahead-of-time compile (triton.compile, no GPU needed).
    options: config.build_for's (expcast, beta, block_n, stages, mean_mma, expcast_tail, p_e5m2, v_terms)."""
    cfg = build_for(head_dim=head_dim, has_mean=has_mean, has_bias=has_bias, pv_perm=pv_perm, **options)
    t = cfg.tiles
    mean_mma = cfg.schedule.mean_mma
    lq, lk, lv = _layouts(t.block_m, t.block_n, head_dim)
    sig = {
        "q_desc": f"tensordesc<i8[{t.block_m}, {head_dim}],{lq!r}>",
        "k_desc": f"tensordesc<i8[{t.block_n}, {head_dim}],{lk!r}>",
        "vt_desc": f"tensordesc<fp8e4nv[{head_dim}, {t.block_n}],{lv!r}>",
        "vlo_desc": f"tensordesc<fp8e4nv[{head_dim}, {t.block_n}],{lv!r}>" if cfg.numerics.v_terms == 2 else "constexpr",
        "QS": "*fp32", "QBAD": "*i8", "KS": "*fp32", "KBAD": "*i8", "VS": "*fp32", "NOCLIP": "*i8",
        "ones_desc": f"tensordesc<fp8e4nv[8, {t.block_n}],{_ones_layout(t.block_n)!r}>",
        "mu_desc": (f"tensordesc<fp32[{', '.join(map(str, _mu_block(head_dim, mean_mma)))}],{_mu_layout(mean_mma)!r}>"
                    if has_mean else "constexpr"),
        "BIAS": "*fp32" if has_bias else "constexpr",
        "stride_bias_b": "i32", "stride_bias_h": "i32",
        "O": f"*{out_dtype}", "stride_ob": "i32", "stride_oh": "i32", "stride_om": "i32", "stride_od": "i32",
        "H": "i32", "M": "i32", "N": "i32", "NBQ": "i32", "NBK": "i32", "NBV": "i32",
        "cfg": "constexpr", "num_warps": "constexpr", "LSE": "constexpr",
    }
    constexprs = dict(cfg=cfg, num_warps=t.num_warps, LSE=None)
    if cfg.numerics.v_terms == 1:
        constexprs["vlo_desc"] = None
    if not has_mean:
        constexprs["mu_desc"] = None
    if not has_bias:
        constexprs["BIAS"] = None
    return sig, constexprs


def vc_attention_fwd_sm90(q_codes, q_scales, q_bad, k_codes, k_scales, k_bad, v_pre, out, H,
                          key_bias_log2=None, expcast=True, beta=None, block_n=None, stages=STAGES, mean_mma=None,
                          expcast_tail=None, lse=None, p_e5m2=None):
    """Launch on prepared operands: the arguments of kernels/pipeline.py::vc_attention_fwd
    (q_codes [BH, M, D] int8, k_codes [BH, N, D], v_pre from quantize_v_residual, out a [B, H, M, D]
    view written in place). Needs contiguous codes (the pre-pass makes them so). Launch options
    (config.build_for; None: as dispatched): block_n, stages, mean_mma, expcast_tail, p_e5m2. V's second
    E4M3 term (v_pre["vt_lo"], quantize_v_residual(v_terms=2)) makes the v_terms=2 build. lse: [BH, M]
    fp32 for each row's log2 LSE, as the portable kernel writes it, or None."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..pipeline import bias_strides, cdiv, mu_tf32_pairs

    if q_codes.dtype != torch.int8 or k_codes.dtype != torch.int8:
        raise ValueError(f"the Hopper kernel takes INT8 Q / K codes (qk_format='int8'), got {q_codes.dtype}, "
                         f"{k_codes.dtype}")
    BH, M, D = q_codes.shape
    N = k_codes.shape[1]
    vt = v_pre["vt"]
    mu = v_pre["mu_scaled"]
    cfg = build_for(head_dim=D, has_mean=mu is not None, has_bias=key_bias_log2 is not None, expcast=expcast,
                    beta=beta, pv_perm=bool(v_pre.get("pv_perm", False)), block_n=block_n, stages=stages,
                    mean_mma=mean_mma, expcast_tail=expcast_tail, p_e5m2=p_e5m2,
                    v_terms=2 if "vt_lo" in v_pre else 1)
    block_m, block_n = cfg.tiles.block_m, cfg.tiles.block_n
    lq, lk, lv = _layouts(block_m, block_n, D)
    q2 = q_codes.reshape(BH * M, D)
    k2 = k_codes.reshape(BH * N, D)
    vt2 = vt.reshape(BH * D, vt.shape[-1])
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [block_m, D], lq)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, D], lk)
    vt_desc = TensorDescriptor(vt2, list(vt2.shape), list(vt2.stride()), [D, block_n], lv)
    vlo_desc = None
    if "vt_lo" in v_pre:
        vlo2 = v_pre["vt_lo"].reshape(BH * D, vt.shape[-1])
        vlo_desc = TensorDescriptor(vlo2, list(vlo2.shape), list(vlo2.stride()), [D, block_n], lv)
    mu_desc = None
    if cfg.schedule.mean_mma:
        # built once per pre-pass (or written by it: quantize_v_residual(mu_tf32=True)); later launches on
        # the same operands reuse it
        mu2 = v_pre.get("mu_tf32_pairs")
        if mu2 is None:
            mu2 = v_pre["mu_tf32_pairs"] = mu_tf32_pairs(mu)
        mu_desc = TensorDescriptor(mu2, list(mu2.shape), list(mu2.stride()), _mu_block(D, True), _mu_layout(True))
    elif mu is not None:
        mu2 = mu.reshape(-1, D)  # [BH * NB, D] fp32
        mu_desc = TensorDescriptor(mu2, list(mu2.shape), list(mu2.stride()), [1, D], _mu_layout())
    sb = bias_strides(key_bias_log2)
    grid = (cdiv(M, block_m), BH)
    with ptx_pass_installed():
        vc_attention_fwd_sm90_kernel[grid](
            q_desc, k_desc, vt_desc, vlo_desc, mu_desc, _ones_desc(q_codes.device, block_n),
            q_scales, q_bad, k_scales, k_bad, v_pre["scale"],
            no_clip_flags(q_scales, k_scales, D, key_bias_log2 is not None, cfg.numerics.codes),
            key_bias_log2, sb[0], sb[1], out, *out.stride(),
            H, M, N, q_scales.shape[1], k_scales.shape[1], 0 if mu is None else mu.shape[1],
            cfg=cfg, num_warps=cfg.tiles.num_warps, LSE=lse)
    return out


def adds_mean_on_tensor_cores(expcast, pv_perm, has_mean, has_bias, block_n=None, mean_mma=None):
    """Whether a launch with these options takes the means' tf32 B operand (Schedule.mean_mma), so that
    the pre-pass writes it (pipeline.quantize_v_residual(mu_tf32=True)) instead of the launch building
    it on the host."""
    if mean_mma is not None:
        return bool(mean_mma) and bool(has_mean)
    return mean_on_tensor_cores(expcast, pv_perm, has_mean, has_bias, block_n)


def compile_sm90(ptx_pass=True, **build):
    """Compile the kernel for sm_90 with no GPU present (CI, precompiling): a CompiledKernel whose
    .asm holds ptx and cubin. build: signature_and_constexprs' keywords; ptx_pass=False compiles
    without ptx_pass.py's rewrite (as on a Triton without the stage hook), cached in a directory of
    its own (Triton 3.6 keys its cache without the hook). Needs a process without TRITON_INTERPRET=1
    (under it @gluon.jit makes interpreted functions)."""
    import contextlib
    import os

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_sm90 needs TRITON_INTERPRET unset (run it in a fresh process)")
    sig, constexprs = signature_and_constexprs(**build)
    with contextlib.ExitStack() as stack:
        if ptx_pass:
            stack.enter_context(ptx_pass_installed())
        else:
            stack.enter_context(knobs.cache.scope())
            knobs.cache.dir = os.path.join(knobs.cache.dir, "without-ptx-pass")
        return triton.compile(GluonASTSource(vc_attention_fwd_sm90_kernel, sig, constexprs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=constexprs["num_warps"]))
