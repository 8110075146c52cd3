"""The readable definition of VC-Attention in plain PyTorch (slow, obviously right, any device).

Every fast kernel in this package is tested against these functions.

    quant.py      INT8 per-block (Q/K), E4M3 per-channel (V residual), FP8 rounding
    expcast.py    P bytes: exp2 + cast, and ExpCast-FP8 straight from the log score
    kmeans.py     Lloyd k-means on value tokens (the grouping of V-Smooth)
    vsmooth.py    joint K/V permutation, 128-row block means, residual
    attention.py  the online-softmax recurrence with mean restoration; the whole pipeline
"""

from .attention import online_attention, reference_vc_attention, exact_attention
from .expcast import expcast_codes, exp2_cast_codes, decode_e4m3
from .kmeans import kmeans_reference
from .quant import quantize_int8_per_block, quantize_e4m3_per_channel, round_to_e4m3
from .vsmooth import permute_tokens, block_means, demean

__all__ = [
    "online_attention",
    "reference_vc_attention",
    "exact_attention",
    "expcast_codes",
    "exp2_cast_codes",
    "decode_e4m3",
    "kmeans_reference",
    "quantize_int8_per_block",
    "quantize_e4m3_per_channel",
    "round_to_e4m3",
    "permute_tokens",
    "block_means",
    "demean",
]
