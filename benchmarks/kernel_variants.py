"""Kernel design choices measured on the GPU, Wan2.2-14B 720p (B=1, H=40, N=75,600, D=128).

Accuracy (8 heads, the first 8 query blocks and the partial last one) against the float64
reference of the same method, and timing of the kernel alone (operands prepared outside the timer):
Q/K as INT8 (default) or E4M3, P by exp2 + cast or ExpCast, and Hopper's FP8 accumulation
promoted every 32/64 keys (pv_imprecise_acc) or not. Results: results/kernel_variants_*.log.

    python3 benchmarks/kernel_variants.py      # on a CUDA GPU, ~2 min
"""
import torch, time
from triton.testing import do_bench
from vc_attention.kernels import plan_v_smooth
from vc_attention.kernels.triton.attention import triton_vc_attention, vc_attention_fwd
from vc_attention.kernels.triton.prepass import quantize_qk_blocks, quantize_v_residual
from vc_attention.kernels.reference import reference_vc_attention, exact_attention
def rel(a,b): return ((a.double()-b.double()).norm()/b.double().norm()).item()
B,H,N,D=1,40,75600,128
g=torch.Generator(device="cuda").manual_seed(0)
q=torch.randn(B,H,N,D,device="cuda",generator=g,dtype=torch.bfloat16)
k=(torch.randn(B,H,N,D,device="cuda",generator=g)+0.3).to(torch.bfloat16)
v=torch.randn(B,H,N,D,device="cuda",generator=g); v[:,:,::997]*=12; v=v.to(torch.bfloat16)
plan=plan_v_smooth(v,num_clusters=64,iters=10)
fl=4*N*N*D*H
# --- accuracy on 8 heads, rows slice
Hs=8; rows=torch.cat([torch.arange(0,1024),torch.arange(N-N%128,N)]).cuda()
qs_,ks_,vs_=q[:,:Hs],k[:,:Hs],v[:,:Hs]; perm=plan.perm[:,:Hs].contiguous()
ex=exact_attention(qs_[:,:,rows],ks_,vs_,dtype=torch.float32)
for fmt in ("int8","fp8"):
  for ec in (False,True):
    ref=reference_vc_attention(qs_[:,:,rows],ks_,vs_,bits=8,v_smooth=True,expcast=ec,perm=perm,qk_format=fmt,dtype=torch.float64)
    for kw in ({}, {"pv_imprecise_acc":32}, {"block_n":64}):
        o=torch.empty_like(qs_)
        try:
            triton_vc_attention(qs_,ks_,vs_,o,v_smooth=True,expcast=ec,perm=perm,qk_format=fmt,**kw)
            print(f"acc fmt={fmt} expcast={ec} {kw}: vs ref {rel(o[:,:,rows],ref):.2e} (ref->bf16 {rel(ref.to(torch.bfloat16),ref):.2e})  vs exact {rel(o[:,:,rows],ex):.3e} ref vs exact {rel(ref,ex):.3e}", flush=True)
        except Exception as e: print("fail", fmt, ec, kw, repr(e)[:300], flush=True)
# --- timing full H=40
for fmt in ("int8","fp8"):
    qc,qsc,qb=quantize_qk_blocks(q,fmt=fmt); qsc.mul_(D**-0.5*1.4426950408889634)
    kc,ksc,kb=quantize_qk_blocks(k,plan.perm.reshape(B*H,N).contiguous(),k.mean(2,dtype=torch.float32).reshape(B*H,D).contiguous(),fmt=fmt)
    pre=quantize_v_residual(v,plan.perm.reshape(B*H,N).contiguous(),True); kbad=kb.amax(1); o=torch.empty_like(q)
    for ec in (False,True):
      for kw in ({}, {"pv_imprecise_acc":64}, {"num_warps":8,"num_stages":4}):
        try:
            ms=do_bench(lambda: vc_attention_fwd(qc,qsc,qb,kc,ksc,kbad,pre,o,H,expcast=ec,**kw),warmup=50,rep=400,return_mode="median")
            print(f"time fmt={fmt} expcast={ec} {kw}: {ms:.1f} ms {fl/ms/1e9:.0f} TF", flush=True)
        except Exception as e: print("fail", fmt, ec, kw, repr(e)[:300], flush=True)
