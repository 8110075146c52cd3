"""V^T's columns in wgmma order (pipeline.pv_key, pv_perm=True): the permutation itself, the pre-pass
that writes it and the Triton twin that reads it, on CPU (Triton's interpreter).

The Hopper kernel (kernels/gluon/attention_sm90.py) uses this order so that P's bytes go from the
score accumulator to the P.V wgmma without moving between lanes; tests/kernels/test_gluon_sm90.py
checks that in its SASS and tests/gpu/test_gluon_sm90_gpu.py checks it against the twin on a GPU."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from vc_attention.kernels.pipeline import prepare_8bit, pv_key  # noqa: E402
from vc_attention.kernels.reference import reference_vc_attention  # noqa: E402
from vc_attention.kernels.triton.attention import vc_attention_fwd  # noqa: E402
from vc_attention.kernels.triton.launch import triton_launch  # noqa: E402


def _lane_sets(i):
    """Lane quad index i of a 32-key chunk: its score-accumulator keys, its A-operand positions."""
    acc_keys = {2 * i + c + 8 * b for b in range(4) for c in range(2)}
    operand_positions = [4 * i + r for r in range(4)] + [16 + 4 * i + r for r in range(4)]
    return acc_keys, operand_positions


@pytest.mark.parametrize("order, lane_local", [(pv_key, True), (lambda a: a, False)])
def test_pv_key_puts_each_lanes_accumulator_keys_in_its_operand_positions(order, lane_local):
    """PTX ISA wgmma fragments, per 32-key chunk: lane quad index i holds score-accumulator keys
    {2i, 2i + 1} + {0, 8, 16, 24} and A-operand positions {4i .. 4i + 3, 16 + 4i .. 16 + 4i + 3}.
    pv_key maps each lane's operand positions onto that lane's own keys (a bijection overall); key
    order does not (Triton must then exchange P between lanes)."""
    assert sorted(order(a) for a in range(32)) == list(range(32))
    local = all({order(a) for a in positions} == keys for keys, positions in map(_lane_sets, range(4)))
    assert local == lane_local


def _inputs(B, H, N, D=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)
    k = (torch.randn(B, H, N, D, generator=g) + 0.3).to(torch.bfloat16)
    v = (torch.randn(B, H, N, D, generator=g) + torch.linspace(-1, 2, D)).to(torch.bfloat16)
    perm = torch.stack([torch.randperm(N, generator=g) for _ in range(B * H)]).reshape(B, H, N)
    return q, k, v, perm


@pytest.mark.parametrize("v_smooth", [True, False])
def test_prepass_writes_vt_in_wgmma_order_and_the_twin_reads_it(v_smooth):
    """N = 200: a partial last chunk, so columns past N (whichever key pv_key puts there) must be 0."""
    B, H, N = 1, 2, 200
    q, k, v, perm = _inputs(B, H, N)
    perm = perm if v_smooth else None
    (ops_key, _), (ops_wg, _) = (prepare_8bit(triton_launch, q, k, v, v_smooth=v_smooth, perm=perm, pv_perm=p)
                                 for p in (False, True))
    vt_key, vt_wg = ops_key[6]["vt"].view(torch.uint8), ops_wg[6]["vt"].view(torch.uint8)
    assert (ops_key[6]["pv_perm"], ops_wg[6]["pv_perm"]) == (False, True)
    cols = torch.tensor([c - c % 32 + pv_key(c % 32) for c in range(vt_key.shape[-1])])
    assert torch.equal(vt_wg, vt_key[..., cols])
    assert not vt_wg[..., cols >= N].any()  # padded keys stay zero wherever they land
    outs = []
    for ops in (ops_key, ops_wg):
        out = torch.full_like(q, float("nan"))
        vc_attention_fwd(*ops, out, H, expcast=True, block_n=128)
        outs.append(out.double())
    ref = reference_vc_attention(q, k, v, bits=8, v_smooth=v_smooth, expcast=True, perm=perm, block_n=128,
                                 dtype=torch.float64)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    # The same sum over keys in another order: equal up to fp32 summation order.
    assert rel(outs[1], outs[0]) < 1e-5
    ref = ref.to(torch.bfloat16).double()
    assert rel(outs[1], ref) < 1e-3 and abs(rel(outs[1], ref) - rel(outs[0], ref)) < 1e-5
