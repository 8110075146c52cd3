"""The proposed Triton byte function for ExpCast with a tail piece (FIDELITY.md "ExpCast tail"), checked
against the torch reference ``vc_attention.kernels.fidelity.expcast_variants.pieces_codes`` (under Triton's
interpreter on CPU, natively on a GPU):

    python benchmarks/fidelity/expcast_tail_triton.py
    python benchmarks/fidelity/expcast_tail_triton.py --device cuda

``_expcast_tail_bytes`` below is what the kernels' ExpCast byte path would become with the tail
piece (the kernels do not carry it). Per element, against today's function (FFMA, FADD, FMNMX, LOP):
+1 FFMA (the tail piece u * a + b) and +1 FMNMX (the max of the two pieces); the rounding (FADD +
FMNMX with the magic constant), the byte mask and the conversion are unchanged. Folding the magic
constant into the FFMA constants does not save the extra op: 120 + beta + 1.5 * 2^23 is not an fp32
number (ulp 1 there), so beta would be lost.
"""

from __future__ import annotations

import os
import sys

_ON_CUDA = "--device=cuda" in sys.argv or any(
    a == "--device" and sys.argv[i + 1:i + 2] == ["cuda"] for i, a in enumerate(sys.argv))
if not _ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vc_attention.kernels.fidelity import expcast_variants as et  # noqa: E402

EXPCAST_TAIL_A = tl.constexpr(1.608)  # expcast_variants.fit_two_piece() at beta = -0.35
EXPCAST_TAIL_B = tl.constexpr(28.128)


@triton.jit
def _expcast_tail_bytes(u, BETA: tl.constexpr):
    """ExpCast-FP8 with a tail piece: byte = clip_[0,120](round(max(8 (u + 8) + 56 + beta, a u + b))).

    The second affine piece follows E4M3's subnormal codes 1..7 (value k * 2^-9, linear in value,
    i.e. k = 2^(u + 17) with P scaled by 2^8) below u = -14, where the first piece alone sends
    everything under u = -14.9 to the byte 0. a, b: least squares in value over u in [-18.5, -14]
    with the rounding included (benchmarks/fidelity/expcast_tail.py). The pieces cross at u = -14.3,
    below the normal range: no byte with u >= -14 changes. -inf still gives the byte 0.
    """
    x = tl.maximum(u * 8.0 + (120.0 + BETA), u * EXPCAST_TAIL_A + EXPCAST_TAIL_B)
    t = tl.maximum(x + 12582912.0, 12582912.0)
    bits = t.to(tl.int32, bitcast=True) & 0xFF
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _bytes_kernel(U, OUT, n, BETA: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = tl.load(U + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, _expcast_tail_bytes(u, BETA).to(tl.uint8, bitcast=True), mask=mask)


def main():
    dev = "cuda" if _ON_CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    u = torch.cat([torch.linspace(-24.0, 0.0, 96_001), -24.0 * torch.rand(32_000, generator=g),
                   torch.tensor([-float("inf"), 0.0, -14.0, -14.3, -17.18, -1e30])]).float()
    out = torch.empty(u.numel(), dtype=torch.uint8)
    BLOCK = 4096
    ud, od = u.to(dev), out.to(dev)
    _bytes_kernel[(triton.cdiv(u.numel(), BLOCK),)](ud, od, u.numel(), BETA=-0.35, BLOCK=BLOCK)
    got = od.cpu()
    ref = et.pieces_codes(u, [(float(EXPCAST_TAIL_A.value), float(EXPCAST_TAIL_B.value))], -0.35)
    ref_plain = et.pieces_codes(u, [], -0.35)
    diff = got.int() - ref.int()
    normal = u >= -14.0
    print(f"{dev}: {u.numel()} u values; bytes differing from the reference: {int((diff != 0).sum())} "
          f"(max |diff| {int(diff.abs().max())}); normal-range bytes differing from plain ExpCast: "
          f"{int((got[normal] != ref_plain[normal]).sum())}; byte(-inf) = {int(got[-6])}, byte(0) = {int(got[-5])}")
    assert int((diff != 0).sum()) <= 1e-4 * u.numel() and int(diff.abs().max()) <= 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
