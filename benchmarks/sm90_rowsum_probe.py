"""The tensor-core row sum in Gluon on Hopper: which way of filling the ones tile works (GPU probe, ~30 s)

    python3 benchmarks/sm90_rowsum_probe.py        # on an sm_90 GPU

The Hopper kernel (kernels/gluon/attention_sm90.py) takes the row sum of P's E4M3 bytes as P times
an [8, BLOCK_N] tile of ones on the tensor cores, as the portable Triton twin does. A first try in
the third session gave wrong sums; this probe isolates the product in one CTA (one warpgroup):
P [64, 64] E4M3 (bytes 0..120, ExpCast's range) times B [64, n] for n in 8..128, B K-major in shared
memory either loaded by TMA from global memory or stored there from registers, P from registers or
from shared memory; a random B by TMA is the control. Each case prints its largest error against
the float64 product, relative to the product's largest entry, and whether that is within the FP8
wgmma's accumulator (Hopper adds FP8 products into a truncated fp32 accumulator: 2^-10 here).

Result on the H200, Triton 3.6 (results/sm90_rowsum_probe_h200_2026-11-29_run2.log, printed with a
first threshold of 2^-12, hence its "WRONG" on the TMA rows): a B tile by TMA is right for every n
and both A paths, to the accumulator's precision (ones 4.9e-4, random 2.2e-4 - 3.7e-4: the same
products and the same truncation as the twin's tl.dot, whose output the kernel now matches bit for
bit); a ones tile stored from registers is wrong (errors 0.5 - 100 times the largest sum). So the
kernel loads its ones tile by TMA.
"""
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
ACC_REL = 2.0 ** -10  # FP8 wgmma accumulation on Hopper (measured up to 4.9e-4 for sums of 64 bytes)


@gluon.jit
def product_kernel(P, OUT, b_desc, NN: gl.constexpr, A_SMEM: gl.constexpr, B_TMA: gl.constexpr,
                   num_warps: gl.constexpr):
    BM: gl.constexpr = 16 * num_warps
    BK: gl.constexpr = 64
    blocked: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, NN, 32])
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, blocked))
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, blocked))
    p = gl.load(P + gl.expand_dims(offs_m, 1) * BK + gl.expand_dims(offs_k, 0))
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [NN, BK], b_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    if B_TMA:
        mbarrier.expect(bar, b_desc.block_type.nbytes)
        _tma_load(b_desc, [0, 0], bar, b_smem)
        mbarrier.wait(bar, 0)
    else:  # ones stored from registers
        fill: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
        b_smem.store(gl.full([NN, BK], 1.0, gl.float32, fill).to(gl.float8e4nv))
        fence_async_shared()
        _cta_barrier()
    acc = gl.zeros([BM, NN], gl.float32, acc_layout)
    if A_SMEM:
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, BK],
                                           gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv))
        a_smem.store(p)
        fence_async_shared()
        _cta_barrier()
        r = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, use_acc=False)
    else:
        a = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=4))
        r = warpgroup_mma(a, b_smem.permute((1, 0)), acc, use_acc=False)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, NN, layout=gl.SliceLayout(0, acc_layout))
    gl.store(OUT + gl.expand_dims(rows, 1) * NN + gl.expand_dims(cols, 0), r)
    mbarrier.invalidate(bar)


def main():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU")
        return 2
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 121, (64, 64), generator=g, device="cuda", dtype=torch.uint8)
    p = codes.view(torch.float8_e4m3fn)
    bad = 0
    for nn in (8, 16, 32, 64, 128):
        for kind in ("ones", "random"):
            b = (torch.ones(nn, 64, device="cuda") if kind == "ones"
                 else torch.randn(nn, 64, device="cuda", generator=g)).to(torch.float8_e4m3fn)
            want = p.double() @ b.double().t()
            layout = gl.NVMMASharedLayout.get_default_for([nn, 64], gl.float8e4nv)
            desc = TensorDescriptor(b, [nn, 64], [64, 1], [nn, 64], layout)
            for b_tma in (True, False):
                if kind == "random" and not b_tma:
                    continue
                for a_smem in (False, True):
                    out = torch.full((64, nn), float("nan"), device="cuda")
                    product_kernel[(1,)](p, out, desc, NN=nn, A_SMEM=a_smem, B_TMA=b_tma, num_warps=4)
                    torch.cuda.synchronize()
                    err = ((out.double() - want).abs().max() / want.abs().max()).item()
                    ok = err <= ACC_REL
                    bad += (not ok) and b_tma
                    print(f"n={nn:3d} B={kind:6s} {'by TMA ' if b_tma else 'stored '} A from "
                          f"{'smem' if a_smem else 'regs'}: max error {err:.2e} of the product's size  "
                          f"{'ok' if ok else 'WRONG'}", flush=True)
    print("TMA-loaded B tiles:", "all right" if not bad else f"{bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
