"""ExpCast-FP8 bytes against the exact E4M3 cast of 2^(u + 8), and the Triton byte path."""

import math

import pytest
import torch

from vc_attention.kernels.reference import decode_e4m3, exp2_cast_codes, expcast_codes

NAN_BYTES = (0x7F, 0xFF)


def test_byte_agreement_on_normal_codes():
    """u in [-14, 0] (codes >= 8, the normal range): >= 79% of bytes identical to the exact cast,
    never more than one code apart, and 120 (= 256) at u = 0."""
    u = torch.linspace(-14.0, 0.0, 280_001, dtype=torch.float64).float()
    direct = expcast_codes(u).int()
    exact = exp2_cast_codes(u).int()
    same = (direct == exact).float().mean().item()
    assert same >= 0.79, same
    assert (direct - exact).abs().max().item() <= 1
    assert expcast_codes(torch.zeros(1)).item() == 120
    assert decode_e4m3(torch.tensor([120], dtype=torch.uint8)).item() == 256.0


def test_the_worked_example():
    """u = -1.60: 8 (u + 8) + 56 - 0.35 = 106.85 -> byte 107 = 8*13 + 3 -> 88; 2^6.4 = 84.4 -> 88."""
    u = torch.tensor([-1.60])
    assert expcast_codes(u).item() == 107
    assert decode_e4m3(expcast_codes(u)).item() == 88.0
    assert decode_e4m3(exp2_cast_codes(u)).item() == 88.0


def test_below_normal_range_clips_to_zero_earlier_but_stays_tiny():
    """u < -14: the exact cast goes subnormal, ExpCast reaches 0 sooner. Both values stay below
    2^-6 (of a row maximum of 256), codes are monotone in u, and nothing is NaN."""
    u = torch.linspace(-30.0, -14.0, 50_001)
    direct = expcast_codes(u)
    exact = exp2_cast_codes(u)
    assert direct.int().max().item() <= 8
    assert torch.all(direct[1:].int() >= direct[:-1].int())
    assert (decode_e4m3(direct) - decode_e4m3(exact)).abs().max().item() <= 2.0 ** -6
    assert (direct[u < -15.0] == 0).all()


def test_never_the_nan_byte():
    u = torch.cat([torch.linspace(-60.0, 1.0, 100_001), torch.tensor([-math.inf, 0.0, 0.5, 3.0])])
    codes = expcast_codes(u)
    for nan_byte in NAN_BYTES:
        assert not (codes == nan_byte).any()
    assert codes.max().item() <= 120
    assert expcast_codes(torch.tensor([-math.inf])).item() == 0
