"""Why did the tensor-core row sum give wrong sums in the Gluon Hopper kernel? (a GPU probe, ~1 min)

    python3 benchmarks/sm90_rowsum_probe.py        # on an sm_90 GPU

The portable Triton kernel takes the row sum of P's E4M3 bytes as P @ ones (a wgmma against a tile
of ones) and is right; the same product in kernels/gluon/attention_sm90.py gave wrong sums on the
H200 with Triton 3.6 (BENCHMARKS.md; results/sm90_gluon_check_h200_2026-11-29_step5.log), so the
shipped kernel sums the bytes on the CUDA cores (3 instructions per score; the wgmma would save
~67 SASS instructions per 128x64 tile). This probe isolates the product: one CTA, 8 warps, P
[128, 64] E4M3 (random bytes of a softmax-like range) times a ones tile [64, n] for n in (8, 16, 32, 64),
with P from registers (dot-operand layout whose parent has n = 128 or n = the product's n) or from
shared memory, and the ones tile written at allocation or by a store. Each case prints its largest
error against P.sum(1) in float64; a wrong case points at the part to report or work around.

Result on the H200, Triton 3.6 (results/sm90_rowsum_probe_h200_2026-11-29.log): every case wrong,
n = 8 to 64, P from registers or shared memory, ones tile stored either way (max error ~4e5 against
sums below 1.7e4), so the fault is in the product itself as Gluon 3.6 builds it, not in the attention
kernel around it. Re-run on each new Triton before switching the kernel's row sum to the tensor cores.
"""
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def rowsum_kernel(P, OUT, ROWS_N: gl.constexpr, A_MODE: gl.constexpr, STORE_ONES: gl.constexpr,
                  num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = 128
    BLOCK_N: gl.constexpr = 64
    blocked: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
    rs_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, ROWS_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, 128, 32])
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blocked))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, blocked))
    p = gl.load(P + gl.expand_dims(offs_m, 1) * BLOCK_N + gl.expand_dims(offs_n, 0))  # E4M3

    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS_N, BLOCK_N], gl.float8e4nv)
    fill: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    ones = gl.full([ROWS_N, BLOCK_N], 1.0, gl.float32, fill).to(gl.float8e4nv)
    if STORE_ONES:
        ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [ROWS_N, BLOCK_N], ones_layout)
        ones_smem.store(ones)
    else:
        ones_smem = gl.allocate_shared_memory(gl.float8e4nv, [ROWS_N, BLOCK_N], ones_layout, ones)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv))
    p_smem.store(p)
    fence_async_shared()
    _cta_barrier()
    acc = gl.zeros([BLOCK_M, ROWS_N], gl.float32, rs_layout)
    b = ones_smem.permute((1, 0))
    if A_MODE == 0:  # registers, parent = the P.V product's layout (what the attention kernel did)
        a = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4))
        rs = warpgroup_mma(a, b, acc, use_acc=False)
    elif A_MODE == 1:  # registers, parent = this product's own layout
        a = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=rs_layout, k_width=4))
        rs = warpgroup_mma(a, b, acc, use_acc=False)
    else:  # shared memory
        rs = warpgroup_mma(p_smem, b, acc, use_acc=False)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rs_layout))
    cols = gl.arange(0, ROWS_N, layout=gl.SliceLayout(0, rs_layout))
    gl.store(OUT + gl.expand_dims(rows, 1) * ROWS_N + gl.expand_dims(cols, 0), rs)


def main():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    # bytes of ExpCast's range: codes 0..120 (values 0 .. 256)
    codes = torch.randint(0, 121, (128, 64), generator=g, device="cuda", dtype=torch.uint8)
    p = codes.view(torch.float8_e4m3fn)
    want = p.double().sum(1)
    bad = 0
    for rows_n in (8, 16, 32, 64):
        for a_mode, a_name in ((0, "A regs, parent n=128"), (1, f"A regs, parent n={rows_n}"), (2, "A smem")):
            for store in (False, True):
                out = torch.full((128, rows_n), float("nan"), device="cuda")
                try:
                    rowsum_kernel[(1,)](p, out, ROWS_N=rows_n, A_MODE=a_mode, STORE_ONES=store, num_warps=8)
                    torch.cuda.synchronize()
                    err = (out.double() - want[:, None]).abs().max().item()
                    ok = err <= 1e-6 * want.abs().max().item()
                    bad += not ok
                    print(f"n={rows_n:2d} {a_name:22s} ones {'stored' if store else 'at alloc'}: "
                          f"max |err| {err:.3e}  {'ok' if ok else 'WRONG'}")
                except Exception as exc:  # report and go on
                    bad += 1
                    print(f"n={rows_n:2d} {a_name:22s} ones {'stored' if store else 'at alloc'}: "
                          f"FAILED {type(exc).__name__}: {str(exc)[:200]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
