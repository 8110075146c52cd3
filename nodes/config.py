"""What a VC-Attention patch node's inputs decide: :class:`PatchConfig` and :func:`resolve_config`.

Shared by both patch nodes (core models in ``patch.py``, WanVideoWrapper models in ``wanvideo.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import kernels
from .schedule import ScheduleConfig

ENV_BACKEND = "VC_ATTENTION_BACKEND"
# The library's low-bit backends (its registry's names; "sdpa" is ComfyUI's own attention here), and
# the node's validation mode "exact".
BACKENDS = ("auto",) + tuple(name for name in kernels.BACKENDS if name != "sdpa") + ("exact",)
BITS = ("8", "4", "off")
PV_FORMATS = ("auto", "fp8", "int8")  # the library's pv_format: how 8-bit P and V are held
EXACT_BITS = 16  # the library's "no quantisation" width, reached only through backend "exact"


@dataclass(frozen=True)
class PatchConfig:
    """Everything the patch node's inputs decide, resolved (environment variable applied)."""

    bits: int | None  # 8, 4, EXACT_BITS (backend "exact") or None ("off": every call passes through)
    backend: str  # a kernels backend name: "auto" | "gluon" | "precompiled" | "triton" | "reference"
    expcast: bool | None  # None = the library's auto choice
    clusters: int
    schedule: ScheduleConfig
    bf16_first_blocks: int = 0
    bf16_last_blocks: int = 0
    # 8-bit only: "int8" = INT8 P and V residual (the RTX kernel's path), "auto" = the library's choice
    # (INT8 on the RTX kernel); precheck() resolves "auto" to what runs
    pv_format: str = "auto"

    @property
    def mode(self) -> str:
        """How the node names this bit width to the user (the node offers 8, 4, off and exact)."""
        if self.bits is None:
            return "off"
        if self.bits == EXACT_BITS:
            return "exact (no quantisation)"
        return "8-bit, INT8 P.V" if self.bits == 8 and self.pv_format == "int8" else f"{self.bits}-bit"


def resolve_config(bits, grouping_window, refresh_every, clusters, expcast, bf16_first_blocks,
                   bf16_last_blocks, bf16_until, backend, pv_format="auto") -> PatchConfig:
    """The node's inputs as a PatchConfig; ``VC_ATTENTION_BACKEND`` overrides ``backend``.

    Backend "exact" is a validation mode: the reference backend with no quantisation (permutation
    and demeaning only), which must reproduce default attention to float tolerance.
    """
    env = os.environ.get(ENV_BACKEND, "").strip().lower()
    if env:
        if env not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND}={env!r} is not one of {', '.join(BACKENDS)}")
        backend = env
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if bits not in BITS:
        raise ValueError(f"bits must be '8', '4' or 'off', got {bits!r}")
    if pv_format not in PV_FORMATS:
        raise ValueError(f"pv_format must be 'auto', 'fp8' or 'int8', got {pv_format!r}")
    if pv_format == "int8" and expcast == "on":
        raise ValueError("pv_format 'int8' makes P by exp2: ExpCast (expcast 'on') writes E4M3 bytes")
    nbits = None if bits == "off" else int(bits)
    if backend == "exact" and nbits is not None:
        nbits, backend = EXACT_BITS, "reference"
    return PatchConfig(
        bits=nbits,
        backend=backend,
        expcast={"auto": None, "on": True, "off": False}[expcast],
        clusters=int(clusters),
        schedule=ScheduleConfig(float(grouping_window), int(refresh_every), float(bf16_until)),
        bf16_first_blocks=int(bf16_first_blocks),
        bf16_last_blocks=int(bf16_last_blocks),
        pv_format=pv_format,
    )
