"""Gluon kernels: hand-scheduled versions of the hot kernel for one GPU architecture each.

    attention_sm90.py  the fused 8-bit forward for Hopper (H100 / H200 / H20): TMA ring and
                       asynchronous wgmma; same operands and bytes as kernels/triton/attention.py

Importing this package needs a Triton with Gluon's Hopper API (3.6 or newer); kernels/dispatch.py
decides whether it is used and says why not. The pre-pass (quantisers, V residual) stays the
portable Triton code of kernels/triton/prepass.py.
"""


def gluon_vc_attention(q, k, v, out, *, v_smooth=True, expcast=True, perm=None, sm_scale=None,
                       key_bias=None, **launch):
    """The whole 8-bit pipeline on [B, H, N, D] views with the Hopper kernel as the fused attention:
    the Triton pre-pass (V^T written in the column order the kernel's P.V operand wants, where that
    pays on this Triton: attention_sm90.pv_perm_for, pipeline.pv_key; and the tf32 B operand of the
    V-Smooth means, pipeline.mu_tf32_pairs), then kernels/gluon/attention_sm90.py. Same arguments as
    kernels/triton/attention.py::triton_vc_attention (qk_format INT8)."""
    from .. import pipeline
    from ..triton.launch import triton_launch
    from .attention_sm90 import adds_mean_on_tensor_cores, pv_perm_for, vc_attention_fwd_sm90

    pv_perm = pv_perm_for()
    mu_tf32 = adds_mean_on_tensor_cores(expcast, pv_perm, v_smooth, key_bias is not None,
                                        launch.get("block_n"), launch.get("mean_mma"))
    return pipeline.vc_attention_8bit(triton_launch, q, k, v, out, v_smooth=v_smooth, expcast=expcast,
                                      perm=perm, sm_scale=sm_scale, key_bias=key_bias,
                                      attention=vc_attention_fwd_sm90, pv_perm=pv_perm, mu_tf32=mu_tf32,
                                      **launch)
