"""The public entry: vc_attention() and explain_backend(), argument checks, the torch custom op.

vc_attention() validates and resolves the options (backend, ExpCast, scale) in Python, then calls
the custom op `vc_attention::attention`, which has a fake (meta) implementation so torch.compile
traces it without graph breaks. A plan crosses the op boundary as its permutation tensor.
"""

import math
from typing import Optional

import torch

from . import dispatch
from .dispatch import BackendDecision, CallSpec, choose_backend
from .plan import VSmoothPlan

LAYOUTS = ("HND", "NHD")
PV_FORMATS = ("auto", "fp8", "int8")


def _to_hnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "HND" else x.transpose(1, 2)


def _check(q, k, v, *, bits, layout, plan, v_smooth, sm_scale, key_bias, attn_mask, pv_format="auto",
           expcast=None):
    """Clear errors for bad input; returns (B, H, M, N, D) in HND terms."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ([B, H, N, D] for layout 'HND', [B, N, H, D] for 'NHD'), "
                             f"got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    qh, kh, vh = (_to_hnd(t, layout) for t in (q, k, v))
    B, H, M, D = qh.shape
    if kh.shape != vh.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if kh.shape[0] != B or kh.shape[1] != H or kh.shape[3] != D:
        raise ValueError(f"q and k/v disagree on batch, heads or head dim ({layout}): q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    N = kh.shape[2]
    if N == 0 or M == 0:
        raise ValueError("q and k/v need at least one token")
    if bits not in dispatch.SUPPORTED_BITS:
        raise ValueError(f"bits must be 8, 4 or 16 (16 = no quantisation, the exact mode), got {bits!r}")
    if pv_format not in PV_FORMATS:
        raise ValueError(f"pv_format must be one of {PV_FORMATS}, got {pv_format!r}")
    if pv_format == "int8" and bits != 8:
        raise ValueError(f"pv_format='int8' is an 8-bit path: pass bits=8 with it (got bits={bits})")
    if pv_format == "int8" and expcast:
        raise ValueError("ExpCast writes FP8 bytes: pv_format='int8' makes P by exp2 (pass expcast=None or False)")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)
                                     and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number or None, got {sm_scale!r}")
    if plan is not None:
        if not isinstance(plan, VSmoothPlan):
            raise TypeError(f"plan must be a VSmoothPlan from plan_v_smooth(), got {type(plan).__name__}")
        if not v_smooth:
            raise ValueError("a plan is V-Smooth's permutation: pass v_smooth=True with it, or no plan")
        if plan.perm.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"the plan's permutation must be int64 or int32, got {plan.perm.dtype}")
        if tuple(plan.perm.shape) != (B, H, N):
            raise ValueError(f"the plan was made for {tuple(plan.perm.shape)} value tokens [B, H, N], "
                             f"this call has {(B, H, N)}: make a new plan for the new shape")
        if plan.perm.device != q.device:
            raise ValueError(f"the plan is on {plan.perm.device}, the tensors on {q.device}")
    for name, mask in (("key_bias", key_bias), ("attn_mask", attn_mask)):
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(mask).__name__}")
        if mask.device != q.device:
            raise ValueError(f"{name} is on {mask.device}, the tensors on {q.device}")
        try:
            torch.broadcast_shapes(mask.shape, (B, H, M, N))
        except RuntimeError:
            raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to [B, H, M, N] = "
                             f"{[B, H, M, N]}") from None
    if key_bias is not None and (key_bias.dim() < 2 or key_bias.shape[-2] != 1):
        raise ValueError(f"key_bias is per key: its query dim (second to last) must be 1, got shape "
                         f"{tuple(key_bias.shape)} (pass query-dependent masks as attn_mask)")
    return B, H, M, N, D


def _mask_as_key_bias(attn_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An SDPA-style mask that is the same for every query -> an additive per-key bias; else None."""
    if attn_mask is None or attn_mask.dim() < 2 or attn_mask.shape[-2] != 1:
        return None
    if attn_mask.dtype == torch.bool:  # SDPA: True means "take part"
        return torch.zeros(attn_mask.shape, device=attn_mask.device).masked_fill(~attn_mask, -math.inf)
    return attn_mask


def _normalise_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias.float()


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, perm: Optional[torch.Tensor],
                    key_bias: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor],
                    is_causal: bool, bits: int, v_smooth: bool, expcast: bool, sm_scale: float,
                    layout: str, backend: str, pv_int8: bool = False) -> torch.Tensor:
    """The custom op's body: the chosen backend's run function on [B, H, N, D] views, writing a new
    tensor in the caller's layout."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dispatch.run(backend, *(_to_hnd(t, layout) for t in (q, k, v, out)), bits=bits, v_smooth=v_smooth,
                 expcast=expcast, perm=perm, sm_scale=sm_scale, key_bias=key_bias, attn_mask=attn_mask,
                 is_causal=is_causal, pv_int8=pv_int8)
    return out


def _attention_fake(q, k, v, perm, key_bias, attn_mask, is_causal, bits, v_smooth, expcast, sm_scale,
                    layout, backend, pv_int8=False):
    return q.new_empty(q.shape)


def _register_op():
    """The custom op, registered once per process. The same code can be imported twice (the pack in
    ComfyUI's custom_nodes/ under its folder name, and the pip-installed library as vc_attention);
    the second import reuses the op the first one registered instead of failing."""
    if hasattr(torch.ops, "vc_attention") and hasattr(torch.ops.vc_attention, "attention"):
        return torch.ops.vc_attention.attention.default
    op = torch.library.custom_op("vc_attention::attention", mutates_args=())(_attention_impl)
    op.register_fake(_attention_fake)
    return op


_attention_op = _register_op()


def _resolve(q, k, v, *, bits, v_smooth, expcast, plan, sm_scale, layout, backend, key_bias,
             attn_mask, is_causal, needs_lse=False, pv_format="auto"):
    _check(q, k, v, bits=bits, layout=layout, plan=plan, v_smooth=v_smooth, sm_scale=sm_scale,
           key_bias=key_bias, attn_mask=attn_mask, pv_format=pv_format, expcast=expcast)
    per_key = not is_causal and (attn_mask is None or _mask_as_key_bias(attn_mask) is not None)
    spec = CallSpec.from_tensors(q, bits=bits, per_key_mask_only=per_key, needs_lse=needs_lse,
                                 pv_int8=pv_format == "int8", pv_auto=pv_format == "auto")
    return choose_backend(spec, backend, expcast)


def explain_backend(q, k, v, *, bits=8, v_smooth=True, expcast=None, plan=None, sm_scale=None,
                    layout="HND", backend="auto", key_bias=None, attn_mask=None,
                    is_causal=False, pv_format="auto") -> BackendDecision:
    """Which backend vc_attention() would run with these arguments, and why the others refuse.
    Same arguments as vc_attention(); print() the result for a readable report."""
    return _resolve(q, k, v, bits=bits, v_smooth=v_smooth, expcast=expcast, plan=plan,
                    sm_scale=sm_scale, layout=layout, backend=backend, key_bias=key_bias,
                    attn_mask=attn_mask, is_causal=is_causal, pv_format=pv_format)


def vc_attention(q, k, v, *, bits=8, v_smooth=True, expcast=None, plan=None, sm_scale=None,
                 layout="HND", backend="auto", key_bias=None, attn_mask=None, is_causal=False,
                 pv_format="auto"):
    """Non-causal attention softmax(Q K^T * sm_scale + bias) V with VC-Attention's low-bit method.

    q: [B, H, M, D], k and v: [B, H, N, D] for layout "HND" ([B, N, H, D] for "NHD"); bf16, fp16
    or fp32. Returns a new tensor of q's shape, layout and dtype; no input is modified.

    bits      8: INT8 Q/K per 128-token block (K smoothed); P and V's residual as pv_format says.
              16: no quantisation (permutation + demeaning + exact mean restoration; a check).
              4: NVFP4 (E2M1 values, E4M3 scale per 16, FP32 scale per head; P NVFP4 per 16 keys,
              no ExpCast) on sm_100 / sm_120; other GPUs: "auto" falls back to SDPA and says why.
    v_smooth  subtract each 128-row block mean of V (after the plan's permutation; bits=4: the
              mean of every 8 rows) and quantise only the residual; the means are added back from
              the softmax row sums (per 8 keys at 4 bits).
    expcast   P bytes by ExpCast-FP8 (True), exp2 + cast (False); None: on for sm_90 / sm_100.
    plan      VSmoothPlan from plan_v_smooth(v): K, V (and key_bias) are permuted by it.
    key_bias  additive per-key bias broadcastable to [B, H, 1, N] (e.g. text padding); attn_mask
              takes any SDPA mask: per-key ones run low-bit, others fall back to SDPA.
    backend   "auto" or one of BACKENDS (kernels/dispatch.py): "gluon" (the Hopper kernel, sm_90),
              "mma" (the mma.sync kernel, sm_89 / sm_120), "precompiled" (cubins for this GPU, no
              Triton needed), "triton", "reference" (readable, any device) or "sdpa".
    pv_format "fp8": E4M3 V residual per channel, FP8 P (every 8-bit kernel). "int8": V's residual
              INT8 per (128-row block, channel), P unsigned INT8 per 128-key tile, one Q scale per
              token, P.V exact in INT32: 5-9 dB closer to exact attention than "fp8" on clean,
              peaked and noisy real-clip probes, 0.7-5.2 dB closer than ComfyUI's INT8 attention
              on every clip (FIDELITY.md), as fast as "fp8" on the H200 proxy (BENCHMARKS.md); the
              mma.sync kernel (RTX 4090 / 5090 / PRO 6000: "mma", or its cubins in "precompiled")
              and the reference only, bits=8, no ExpCast (elsewhere "auto" raises with each
              backend's reason). "auto" (the default): "int8" where the chosen kernel makes it its
              default (the mma.sync kernel and its cubins) and ExpCast is not asked for, else
              "fp8"; explain_backend says which.
    """
    decision = _resolve(q, k, v, bits=bits, v_smooth=v_smooth, expcast=expcast, plan=plan,
                        sm_scale=sm_scale, layout=layout, backend=backend, key_bias=key_bias,
                        attn_mask=attn_mask, is_causal=is_causal, pv_format=pv_format)
    D = q.shape[-1]
    scale = float(D ** -0.5 if sm_scale is None else sm_scale)
    bias = _normalise_bias(key_bias if key_bias is not None else _mask_as_key_bias(attn_mask))
    mask = None
    if not dispatch.REGISTRY[decision.backend].per_key_masks_only and attn_mask is not None:
        # a backend that takes any mask (SDPA) takes it as given, in q's dtype
        bias = None
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)
    return _attention_op(q, k, v, plan.perm if plan is not None else None, bias, mask, bool(is_causal),
                         int(bits), bool(v_smooth), bool(decision.expcast), scale, layout, decision.backend,
                         bool(decision.pv_int8))


def vc_attention_lse(q, k, v, *, bits=8, v_smooth=True, expcast=None, plan=None, sm_scale=None,
                     layout="HND", backend="auto", key_bias=None, pv_format="auto"):
    """vc_attention() that also returns each query row's log-sum-exp: (out, lse [B, H, M] fp32,
    natural log of sum_j exp(q . k_j * sm_scale + bias_j) as the method sums it), what merging the
    outputs of key chunks needs (ring attention: kernels/sequence_parallel.py). Only the backends
    whose registry record writes it run ("auto": the Hopper kernel on sm_90, the mma.sync one on
    sm_89 / sm_120, else the portable Triton kernel, or the reference); a plain function, not the custom op (torch.compile sees a
    graph break)."""
    decision = _resolve(q, k, v, bits=bits, v_smooth=v_smooth, expcast=expcast, plan=plan,
                        sm_scale=sm_scale, layout=layout, backend=backend, key_bias=key_bias,
                        attn_mask=None, is_causal=False, needs_lse=True, pv_format=pv_format)
    D = q.shape[-1]
    scale = float(D ** -0.5 if sm_scale is None else sm_scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    B, H, M = _to_hnd(q, layout).shape[:3]
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    dispatch.run(decision.backend, *(_to_hnd(t, layout) for t in (q, k, v, out)), bits=int(bits),
                 v_smooth=bool(v_smooth), expcast=bool(decision.expcast),
                 perm=plan.perm if plan is not None else None, sm_scale=scale,
                 key_bias=_normalise_bias(key_bias), attn_mask=None, is_causal=False, lse=lse,
                 pv_int8=bool(decision.pv_int8))
    return out, lse
