"""The one place that decides which backend runs a VC-Attention call, and says why.

Backends, in the order "auto" tries them:

    gluon      the Hopper kernel (kernels/gluon/attention_sm90.py: TMA ring, asynchronous wgmma)
               behind the same Triton pre-pass: sm_90 only (H100 / H200 / H20), bits=8 (ExpCast, the
               sm_90 default, or exp2 + cast), head dim 128, per-key bias at most. Measured on the
               H200 (BENCHMARKS.md, fourth session) at 0.51-0.61x the time of the portable Triton
               kernel with ExpCast (Wan2.2 720p: 155 vs 259 ms; 1.13x FlashAttention-4 BF16) and
               0.70-0.81x with exp2 + cast (since then 1.48-1.54x and 1.18-1.21x FA4 BF16: fourteenth
               session). Refused where Triton has no Gluon Hopper API.
    precompiled  the same 8-bit kernels as cubins built ahead of time for this exact GPU
               architecture (kernels/precompiled/), launched through the CUDA driver: no Triton, no
               compiler at run time. Refused when no cubin matches this GPU (a cubin for another
               architecture cannot run), or the CUDA driver cannot be reached.
    triton     the fused 8-bit kernels (kernels/triton/): CUDA sm_89+ (FP8 tensor cores), head dim
               64 or 128, bf16/fp16/fp32, bits=8, per-key bias at most. Also runs on the CPU under
               TRITON_INTERPRET=1 when asked for explicitly (the CI path).
               bits=4: the NVFP4 kernel (kernels/triton/attention_fp4.py) on sm_100 / sm_120 only
               (FP4 tensor cores: B200, RTX 5090, RTX PRO 6000); other GPUs are refused with the
               reason (callers such as the patch node then run bits=8).
    reference  the readable PyTorch method (kernels/reference/): any device, slow. "auto" takes it
               only for bits=16 (the exact mode, which has no fast kernel); otherwise on request.
    sdpa       torch's scaled_dot_product_attention: not low-bit, always there; the safe fallback.

Each backend states its constraints as data and returns the reason it refuses a call; the decision
keeps every reason, and "auto" logs the reason for a fallback once.
"""

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger("vc_attention")

BACKENDS = ("gluon", "precompiled", "triton", "reference", "sdpa")
SUPPORTED_BITS = (4, 8, 16)


@functools.lru_cache(maxsize=None)
def triton_status():
    """(available, reason): can the Triton kernels be imported here?"""
    try:
        import triton  # noqa: F401

        from .triton import attention  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken Triton install (DLL load failed, ...)
        return False, f"Triton kernels cannot be imported: {type(exc).__name__}: {exc}"
    return True, ""


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple:
    """(major, minor) of the installed Triton, (0, 0) when it cannot be imported."""
    try:
        import triton

        return tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:2])
    except Exception:
        return (0, 0)


@functools.lru_cache(maxsize=None)
def gluon_status():
    """(available, reason): can the Hopper Gluon kernel be imported here?"""
    try:
        from .gluon import attention_sm90  # noqa: F401
    except Exception as exc:  # no Gluon (Triton < 3.6), or its Hopper API moved again
        return False, f"the Gluon Hopper kernel cannot be imported: {type(exc).__name__}: {exc}"
    return True, ""


@functools.lru_cache(maxsize=None)
def precompiled_status(capability: tuple):
    """(available, reason, {(head_dim, dtype name)}) of the precompiled cubins for this GPU arch."""
    try:
        from . import precompiled
    except Exception as exc:
        return False, f"the precompiled loader cannot be imported: {type(exc).__name__}: {exc}", frozenset()
    return precompiled.status(capability[0] * 10 + capability[1])


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_capability(device: torch.device) -> Optional[tuple]:
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


@dataclass(frozen=True)
class CallSpec:
    """What the dispatcher needs to know about one call (no tensor data)."""

    device_type: str
    capability: Optional[tuple]
    dtype: torch.dtype
    head_dim: int
    bits: int
    per_key_mask_only: bool = True  # False: a query-dependent or causal mask
    interpreting: bool = False

    @classmethod
    def from_tensors(cls, q, *, bits, per_key_mask_only=True):
        return cls(device_type=q.device.type, capability=device_capability(q.device),
                   dtype=q.dtype, head_dim=q.shape[-1], bits=bits,
                   per_key_mask_only=per_key_mask_only, interpreting=interpreting())


@dataclass
class BackendDecision:
    """backend: the one that runs; low_bit: whether it is a VC-Attention backend (not SDPA);
    reasons: backend -> why it was refused; requested: what the caller asked for."""

    backend: str
    low_bit: bool
    requested: str
    reasons: dict = field(default_factory=dict)
    expcast: bool = False
    bits: Optional[int] = None

    @property
    def fallback(self) -> bool:
        return not self.low_bit

    def __str__(self) -> str:
        head = f"VC-Attention backend: {self.backend}"
        if self.backend == "gluon":
            head += f" (8-bit Hopper kernel, P by {'ExpCast' if self.expcast else 'exp2 + cast'})"
        elif self.backend == "triton" and self.bits == 4:
            head += " (4-bit NVFP4, P by exp2 + NVFP4 per 16 keys)"
        elif self.backend in ("triton", "precompiled"):
            head += f" (8-bit, P by {'ExpCast' if self.expcast else 'exp2 + cast'})"
        lines = [head] + [f"  {name} refused: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


# Constraints as data, one entry per backend.
MASK_REFUSAL = "a query-dependent or causal mask: V-Smooth's permutation is exact only with per-key masks"
TRITON_MIN_CAPABILITY = (8, 9)
TRITON_HEAD_DIMS = (64, 128)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP4_CAPABILITY_MAJORS = (10, 12)  # sm_100 / sm_103 (B200, B300), sm_120 / sm_121 (RTX 50xx, RTX PRO)
# The oldest Triton that builds the NVFP4 kernel per architecture (compiled here for each target):
# sm_100 fails in TritonGPUOptimizeAccumulatorInit under 3.6 and 3.8; sm_120 builds with 3.6.
FP4_MIN_TRITON = {10: (3, 9), 12: (3, 6)}


def refuse_triton(spec: CallSpec) -> Optional[str]:
    ok, why = triton_status()
    if not ok:
        return why
    if spec.bits not in (4, 8):
        return f"the Triton kernels are 8-bit and 4-bit; bits={spec.bits} is not a kernel path"
    if (spec.bits == 4 and spec.device_type == "cuda" and spec.capability is not None
            and spec.capability[0] not in FP4_CAPABILITY_MAJORS):
        major, minor = spec.capability
        return (f"the 4-bit NVFP4 kernel needs FP4 tensor cores (sm_100 B200, sm_120 RTX 5090 / "
                f"RTX PRO 6000); this GPU is sm_{major}{minor}: use bits=8")
    if spec.bits == 4 and spec.device_type == "cuda" and spec.capability is not None:
        need = FP4_MIN_TRITON.get(spec.capability[0], (0, 0))
        if triton_version() < need:
            major, minor = spec.capability
            have = ".".join(map(str, triton_version()))
            return (f"Triton {have} cannot build the 4-bit NVFP4 kernel for sm_{major}{minor} "
                    f"(Triton {need[0]}.{need[1]} or newer can): use bits=8 or upgrade Triton")
    if not spec.per_key_mask_only:
        return MASK_REFUSAL
    if spec.device_type != "cuda" and not spec.interpreting:
        return f"tensors are on {spec.device_type}, not a CUDA GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"
    if spec.device_type == "cuda" and spec.capability is not None and spec.capability < TRITON_MIN_CAPABILITY:
        major, minor = spec.capability
        return f"FP8 tensor cores need sm_89 or newer; this GPU is sm_{major}{minor}"
    if spec.head_dim not in TRITON_HEAD_DIMS:
        return f"head dim {spec.head_dim} (the kernel supports {TRITON_HEAD_DIMS})"
    if spec.dtype not in TRITON_DTYPES:
        return f"dtype {spec.dtype} (the kernel takes bf16, fp16 or fp32)"
    return None


GLUON_CAPABILITIES = ((9, 0),)  # wgmma and TMA: Hopper only (sm_90a)
GLUON_HEAD_DIMS = (128,)


def refuse_gluon(spec: CallSpec, expcast: bool = True) -> Optional[str]:
    # expcast: either way (the Hopper kernel is the faster one with exp2 + cast too since the
    # fourth session); kept so every refuse_* takes what the call asks for.
    if spec.bits != 8:
        return f"the Hopper kernel is 8-bit; bits={spec.bits} has none"
    if not spec.per_key_mask_only:
        return MASK_REFUSAL
    if spec.device_type != "cuda":
        return f"tensors are on {spec.device_type}, not a CUDA GPU (Gluon kernels do not run in the interpreter)"
    if spec.capability not in GLUON_CAPABILITIES:
        where = "unknown" if spec.capability is None else f"sm_{spec.capability[0]}{spec.capability[1]}"
        return f"the Gluon kernel uses Hopper's wgmma and TMA (sm_90); this GPU is {where}"
    if spec.head_dim not in GLUON_HEAD_DIMS:
        return f"head dim {spec.head_dim} (the Hopper kernel is built for {GLUON_HEAD_DIMS})"
    if spec.dtype not in TRITON_DTYPES:
        return f"dtype {spec.dtype} (the kernel takes bf16, fp16 or fp32)"
    ok, why = triton_status()  # the pre-pass (quantisers, V residual) is the Triton code
    if not ok:
        return why
    ok, why = gluon_status()
    if not ok:
        return why
    return None


PRECOMPILED_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def refuse_precompiled(spec: CallSpec) -> Optional[str]:
    if spec.bits != 8:
        return f"the cubins are the 8-bit kernels; bits={spec.bits} has none"
    if not spec.per_key_mask_only:
        return MASK_REFUSAL
    if spec.device_type != "cuda":
        return f"tensors are on {spec.device_type}, not a CUDA GPU (cubins run through the CUDA driver)"
    if spec.capability is None:
        return "the GPU's compute capability is unknown"
    if spec.capability < TRITON_MIN_CAPABILITY:
        major, minor = spec.capability
        return f"FP8 tensor cores need sm_89 or newer; this GPU is sm_{major}{minor}"
    if spec.head_dim not in TRITON_HEAD_DIMS:
        return f"head dim {spec.head_dim} (the kernel supports {TRITON_HEAD_DIMS})"
    if spec.dtype not in PRECOMPILED_DTYPE_NAMES:
        return f"dtype {spec.dtype} (the kernel takes bf16, fp16 or fp32)"
    ok, why, configs = precompiled_status(tuple(spec.capability))
    if not ok:
        return why
    if (spec.head_dim, PRECOMPILED_DTYPE_NAMES[spec.dtype]) not in configs:
        return f"the cubins for this GPU have no kernel for head dim {spec.head_dim} with {spec.dtype}"
    return None


def refuse_reference(spec: CallSpec, requested: str) -> Optional[str]:
    if spec.bits not in (4, 8, 16):
        return f"the reference implements bits=4, 8 and 16, not bits={spec.bits}"
    if not spec.per_key_mask_only:
        return MASK_REFUSAL
    if requested == "auto" and spec.bits != 16:
        return "the readable reference is slow: used on request (backend='reference') or for bits=16"
    return None


def expcast_default(spec: CallSpec) -> bool:
    """ExpCast pays where the exp unit limits as much as the tensor cores: sm_90 and sm_100."""
    return spec.capability is not None and spec.capability[0] in (9, 10)


_logged = set()


def log_once(message: str, level=logging.WARNING) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def choose_backend(spec: CallSpec, requested: str = "auto", expcast: Optional[bool] = None) -> BackendDecision:
    """Pick the backend for a call. An explicit request that cannot run raises with the reason;
    "auto" falls back to SDPA and logs why once."""
    if requested not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {requested!r}")
    if spec.bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {spec.bits}")
    use_expcast = expcast_default(spec) if expcast is None else bool(expcast)
    reasons = {}
    candidates = BACKENDS if requested == "auto" else (requested,)
    for name in candidates:
        if name == "gluon":
            why = refuse_gluon(spec, use_expcast)
        elif name == "precompiled":
            why = refuse_precompiled(spec)
        elif name == "triton":
            why = refuse_triton(spec)
        elif name == "reference":
            why = refuse_reference(spec, requested)
        else:
            why = None
        if why is None:
            decision = BackendDecision(name, low_bit=name != "sdpa", requested=requested,
                                       reasons=reasons, expcast=use_expcast and spec.bits == 8,
                                       bits=spec.bits if name != "sdpa" else None)
            if name == "sdpa" and requested == "auto":
                log_once("VC-Attention falls back to torch SDPA (not low-bit): "
                         + "; ".join(f"{k}: {v}" for k, v in reasons.items()))
            return decision
        reasons[name] = why
    raise RuntimeError(f"VC-Attention backend {requested!r} cannot run this call: {reasons[requested]}")
