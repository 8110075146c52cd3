"""Gluon kernels: hand-scheduled versions of the hot kernel for one GPU architecture each.

The fused 8-bit forward for Hopper (H100 / H200 / H20), in parts:

    attention_sm90.py  the kernel: the consumers' key-tile loop and the warp-specialised CTA
    ring.py            the TMA ring between the producer warp and the consumers, its barriers
    softmax.py         scores -> P's FP8 bytes (ExpCast or exp2) and the online-softmax state
    accumulate.py      O and the row sum: P.V, V-Smooth's mean (fp32, or a tf32 wgmma)
    ptx.py             the hand-written PTX (named barriers, a fence, P's byte packing)
    ptx_pass.py        the rewrite of Triton's PTX that drops a barrier Gluon cannot avoid
    config.py          one build's constexprs (tiles, schedule, numerics) and their choice
    launch_sm90.py     host side: descriptors, the launch, the ahead-of-time compile

Same operands and bytes as kernels/triton/attention.py. Importing this package needs a Triton with
Gluon's Hopper API (3.6 or newer); kernels/dispatch.py decides whether it is used and says why not.
The pre-pass (quantisers, V residual) stays the portable Triton code of kernels/triton/prepass.py.
Importing the package imports the kernel, so it fails where the kernel cannot be built.
"""

from . import launch_sm90
from .config import pv_perm_for


def gluon_vc_attention(q, k, v, out, *, v_smooth=True, expcast=True, perm=None, sm_scale=None,
                       key_bias=None, **launch):
    """The whole 8-bit pipeline on [B, H, N, D] views with the Hopper kernel as the fused attention:
    the Triton pre-pass (V^T written in the column order the kernel's P.V operand wants, where that
    pays on this Triton: config.pv_perm_for, pipeline.pv_key; and the tf32 B operand of the
    V-Smooth means, pipeline.mu_tf32_pairs), then launch_sm90.vc_attention_fwd_sm90. Same arguments
    as kernels/triton/attention.py::triton_vc_attention (qk_format INT8); launch: block_n, stages,
    mean_mma (launch_sm90.vc_attention_fwd_sm90), v_terms (2: V's residual in two E4M3 terms,
    pipeline.quantize_v_residual)."""
    from .. import pipeline
    from ..triton.launch import triton_launch

    pv_perm = pv_perm_for()
    mu_tf32 = launch_sm90.adds_mean_on_tensor_cores(expcast, pv_perm, v_smooth, key_bias is not None,
                                                    launch.get("block_n"), launch.get("mean_mma"))
    return pipeline.vc_attention_8bit(triton_launch, q, k, v, out, v_smooth=v_smooth, expcast=expcast,
                                      perm=perm, sm_scale=sm_scale, key_bias=key_bias,
                                      attention=launch_sm90.vc_attention_fwd_sm90, pv_perm=pv_perm,
                                      mu_tf32=mu_tf32, **launch)
