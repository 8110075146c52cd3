"""Hopper's FP8 P V accumulation: the fused kernel against the float64 reference (rounded to the
bf16 output) with the tensor core's reduced-precision accumulation over a whole 128-key tile, or
promoted to fp32 every 32 or 64 keys, for plain 8-bit V and for V-Smooth's centred residual.
This measurement set the default (kernels/triton/attention.py, vc_attention_fwd). Results:
results/pv_accumulation_*.log.

    python3 benchmarks/pv_accumulation.py      # on a CUDA GPU, ~1 min
"""
import torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
from kernel_helpers import video_like_qkv
from vc_attention.kernels import vc_attention, plan_v_smooth
from vc_attention.kernels.triton.attention import triton_vc_attention
from vc_attention.kernels.reference import reference_vc_attention
def rel(a,b): return ((a.double()-b.double()).norm()/b.double().norm()).item()
for N,D in [(200,64),(1000,128),(20000,128)]:
    q,k,v=[t.cuda() for t in video_like_qkv(1,2,N,D,seed=N+D,dtype=torch.bfloat16)]
    for vs in (False, True):
        ref=reference_vc_attention(q,k,v,bits=8,v_smooth=vs,expcast=False,dtype=torch.float64)
        for kw in ({}, {"pv_imprecise_acc":32}, {"pv_imprecise_acc":64}):
            o=torch.empty_like(q); triton_vc_attention(q,k,v,o,v_smooth=vs,expcast=False,**kw)
            print(f"N={N} D={D} vsmooth={vs} {kw}: vs ref(bf16) {rel(o, ref.to(torch.bfloat16)):.2e}  vs ref {rel(o,ref):.2e}  bf16 floor {rel(ref.to(torch.bfloat16),ref):.2e}", flush=True)
