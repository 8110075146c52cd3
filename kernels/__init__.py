"""VC-Attention kernel library (no ComfyUI here).

    from vc_attention.kernels import vc_attention, plan_v_smooth
    plan = plan_v_smooth(v)                        # k-means grouping of the value tokens
    out = vc_attention(q, k, v, bits=8, plan=plan)  # [B, H, N, D] in, same out

explain_backend() says which backend a call would run and why the others refuse; BACKENDS names
the backends in the order "auto" tries them (kernels/dispatch.py holds their records).
"""

from .api import explain_backend, vc_attention, vc_attention_lse
from .dispatch import BACKENDS, BackendDecision
from .plan import COLD_ITERS, DEFAULT_CLUSTERS, WARM_ITERS, VSmoothPlan, plan_v_smooth

__all__ = ["vc_attention", "vc_attention_lse", "plan_v_smooth", "explain_backend", "VSmoothPlan", "BackendDecision", "BACKENDS",
           "COLD_ITERS", "WARM_ITERS", "DEFAULT_CLUSTERS"]
