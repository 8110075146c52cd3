"""The backend registry: the one place that decides which backend runs a VC-Attention call, and why.

One record per backend, in the order "auto" tries them (BACKENDS):

    gluon        the Hopper kernel (kernels/gluon/: TMA ring, asynchronous wgmma) behind the Triton
                 pre-pass: sm_90 (H100 / H200 / H20), 8-bit, head dim 128. JIT only (its host code
                 builds TMA descriptors per call): without Triton an sm_90 GPU runs `precompiled`.
    mma          the 8-bit kernel for warp-level mma.sync GPUs (kernels/triton/attention_mma.py):
                 sm_89 (RTX 4090) and sm_120 (RTX 5090 / RTX PRO 6000).
    precompiled  the 8-bit kernels as cubins built ahead of time for this GPU architecture
                 (kernels/precompiled/), launched through the CUDA driver: no Triton at run time.
                 sm_89 / sm_120: the mma.sync kernel's cubins; sm_90 / sm_100: the portable kernel's;
                 a newer GPU without cubins: the sm_89 PTX, JIT-compiled by the driver
                 (precompiled/specs.py RECORD_ARCHS, PTX_ARCHS: the claim as data).
    triton       the portable kernels (kernels/triton/): 8-bit on sm_89 and newer; 4-bit NVFP4 on
                 sm_100 / sm_120 (FP4 tensor cores). Also on the CPU under TRITON_INTERPRET=1.
    reference    the readable PyTorch method (kernels/reference/): any device, slow; "auto" takes it
                 only for bits=16 (the exact mode, which has no fast kernel).
    sdpa         torch's scaled_dot_product_attention: not low-bit, always there; the fallback.

A record states its constraints as data (bit widths, GPUs, head dims, dtypes, mask kinds, what must be
importable), its build-variant choices (where P by ExpCast is the default; where pv_format="auto"
takes the INT8 P.V path: the mma.sync kernel and its cubins) and its run function. One
check, refusal(), turns the data into the reason a record refuses a call; choose_backend() keeps every
reason, api.vc_attention() calls the chosen record's run function, plan_v_smooth() asks
choose_kmeans(), explain_backend() and the doctor print the same reasons.
"""

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .pipeline import HEAD_DIMS, IO_DTYPES, interpreting

log = logging.getLogger("vc_attention")

SUPPORTED_BITS = (4, 8, 16)
MASK_REFUSAL = "a query-dependent or causal mask: V-Smooth's permutation is exact only with per-key masks"


# --- what the environment offers (cached; the tests replace these) -----------------------------

def _import_reason(what: str, exc: Exception) -> str:
    return f"{what} cannot be imported: {type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=None)
def triton_status():
    """(available, reason): can the Triton kernels be imported here?"""
    try:
        import triton  # noqa: F401

        from .triton import attention  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken Triton install (DLL load failed, ...)
        return False, _import_reason("Triton kernels", exc)
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
    """(available, reason): can the Hopper Gluon kernel package be imported here?"""
    try:
        from . import gluon  # noqa: F401
    except Exception as exc:  # no Gluon (Triton < 3.6), or its Hopper API moved again
        return False, _import_reason("the Gluon Hopper kernel", exc)
    return True, ""


@functools.lru_cache(maxsize=None)
def mma_status():
    """(available, reason): can the mma.sync kernel (kernels/triton/attention_mma.py) be imported?"""
    try:
        from .triton.attention_mma import mma_vc_attention  # noqa: F401
    except Exception as exc:
        return False, _import_reason("the mma.sync kernel (kernels/triton/attention_mma.py)", exc)
    return True, ""


@functools.lru_cache(maxsize=None)
def precompiled_status(capability: tuple):
    """(available, reason, {(head_dim, dtype name)}) of the precompiled cubins for this GPU arch."""
    try:
        from . import precompiled
    except Exception as exc:
        return False, _import_reason("the precompiled loader", exc), frozenset()
    return precompiled.status(capability[0] * 10 + capability[1])


@functools.lru_cache(maxsize=None)
def cubins_kernel(capability: tuple) -> Optional[str]:
    """The attention kernel the installed cubins run on this GPU arch: that of its own folder, else of
    the older arch whose PTX the driver compiles for it (precompiled.select); None without cubins."""
    from . import precompiled
    from .precompiled.specs import attention_kernel

    try:
        folder, _ = precompiled.select(capability[0] * 10 + capability[1])
    except precompiled.PrecompiledError:
        return None
    return attention_kernel(int(folder.name[3:]))


def device_capability(device: torch.device) -> Optional[tuple]:
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


@dataclass(frozen=True)
class CallSpec:
    """What the registry needs to know about one call (no tensor data)."""

    device_type: str
    capability: Optional[tuple]
    dtype: torch.dtype
    head_dim: int
    bits: int
    per_key_mask_only: bool = True  # False: a query-dependent or causal mask
    interpreting: bool = False
    needs_lse: bool = False  # the caller also wants each row's log-sum-exp (ring attention)
    pv_int8: bool = False  # pv_format="int8": P and V's residual in INT8 (the RTX kernel's path)
    pv_auto: bool = False  # pv_format="auto": INT8 where the chosen kernel makes it its default

    @classmethod
    def from_tensors(cls, q, *, bits, per_key_mask_only=True, needs_lse=False, pv_int8=False, pv_auto=False):
        return cls(device_type=q.device.type, capability=device_capability(q.device),
                   dtype=q.dtype, head_dim=q.shape[-1], bits=bits,
                   per_key_mask_only=per_key_mask_only, interpreting=interpreting(), needs_lse=needs_lse,
                   pv_int8=pv_int8, pv_auto=pv_auto)


def _sm(capability: Optional[tuple]) -> str:
    return "unknown" if capability is None else f"sm_{capability[0]}{capability[1]}"


# --- the records ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPUs:
    """Compute capabilities as data: exact (major, minor) pairs, or majors, or a minimum; `need` says
    what the kernel needs (the first half of its refusal), `hint` what to do instead."""

    exact: tuple = ()
    majors: tuple = ()
    minimum: Optional[tuple] = None
    need: str = ""
    hint: str = ""

    def admits(self, capability: Optional[tuple]) -> bool:
        if capability is None:
            return False
        return (tuple(capability) in self.exact or capability[0] in self.majors
                or (self.minimum is not None and tuple(capability) >= self.minimum))

    def refusal(self, capability: Optional[tuple]) -> str:
        return f"{self.need}; this GPU is {_sm(capability)}{self.hint}"


@dataclass(frozen=True)
class Kernel:
    """One kernel of a backend: its bit width, where it runs, what str(BackendDecision) calls it
    ({p}: how P is made), and its run function (loaded when first called).

    run(q, k, v, out, *, bits, v_smooth, expcast, perm, sm_scale, key_bias, attn_mask, is_causal, lse,
    pv_int8): [B, H, N, D] views; out [B, H, M, D] written in place; lse None, or (kernels with
    lse=True) a [B, H, M] fp32 tensor filled with each row's natural-log log-sum-exp; pv_int8 True
    only for kernels with pv_int8=True (P and V's residual in INT8: pv_format="int8")."""

    bits: int
    load: Callable[[], Callable]
    label: str = ""
    gpus: Optional[GPUs] = None  # None: any device the backend takes
    min_triton: tuple = ()  # ((capability major, (Triton major, minor)), ...): the oldest that builds it
    name: str = ""  # how a refusal of min_triton names it
    lse: bool = False  # writes the log-sum-exp on request
    pv_int8: bool = False  # has the INT8 P.V path (pv_format="int8")
    pv_int8_default: bool = False  # pv_format="auto" takes that path here (where the call can)


@dataclass(frozen=True)
class Backend:
    """One backend's record: its kernels (one per bit width) and the constraints they share, what
    it needs at run time, where "auto" takes it, its ExpCast default, and its k-means (if any)."""

    name: str
    description: str
    kernels: tuple  # one Kernel per bit width
    subject: str = ""  # how a refusal names it: "the Hopper kernel"
    cuda_only: bool = True
    interpreter: str = ""  # "auto" / "request": runs on the CPU under TRITON_INTERPRET=1 (when asked)
    cpu_hint: str = ""  # why (and how) it does not take CPU tensors
    head_dims: Optional[tuple] = HEAD_DIMS  # None: any
    dtypes: Optional[tuple] = IO_DTYPES
    per_key_masks_only: bool = True
    needs: tuple = ()  # what must be importable or present: names in REQUIREMENTS
    auto_bits: Optional[tuple] = None  # bit widths "auto" may choose it for (None: all of its kernels)
    auto_refusal: str = ""
    expcast_majors: tuple = ()  # GPU generations where P by ExpCast is the default build
    low_bit: bool = True
    kmeans: Optional[Callable[[], Callable]] = None  # its k-means for plan_v_smooth (choose_kmeans)
    kmeans_needs: tuple = ()  # names in REQUIREMENTS its k-means needs
    kmeans_refusal: Optional[Callable] = None  # x on a GPU -> reason its k-means cannot take x, or None

    @property
    def bits(self) -> tuple:
        return tuple(kernel.bits for kernel in self.kernels)

    def kernel(self, bits: int) -> Optional[Kernel]:
        return next((kernel for kernel in self.kernels if kernel.bits == bits), None)

    def expcast_default(self, capability: Optional[tuple]) -> bool:
        return capability is not None and capability[0] in self.expcast_majors


def _bits_text(bits) -> str:
    return " and ".join(f"{b}-bit" for b in bits)


def _or(items) -> str:
    items = [str(item) for item in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def refusal(record: Backend, spec: CallSpec, requested: str = "auto") -> Optional[str]:
    """Why `record` cannot run this call, or None: its constraints in order (bits, mask, device, GPU,
    Triton version, head dim, dtype, what "auto" may take), then what must be importable."""
    kernel = record.kernel(spec.bits)
    if kernel is None:
        return f"{record.subject}: {_bits_text(record.bits)} only, bits={spec.bits} has none"
    if record.per_key_masks_only and not spec.per_key_mask_only:
        return MASK_REFUSAL
    if spec.needs_lse and not kernel.lse:
        return f"{record.subject}: does not write the log-sum-exp (ring attention needs it)"
    if spec.pv_int8 and not kernel.pv_int8:
        return (f"{record.subject}: has no INT8 P.V path (pv_format='int8': the mma.sync kernel on sm_89 / "
                f"sm_120, its cubins, or the reference)")
    on_cpu_interpreter = spec.device_type != "cuda" and record.interpreter and spec.interpreting
    if record.cuda_only and spec.device_type != "cuda":
        if not on_cpu_interpreter:
            return f"tensors are on {spec.device_type}, not a CUDA GPU{record.cpu_hint}"
        if record.interpreter == "request" and requested != record.name:
            return (f"under TRITON_INTERPRET=1 'auto' takes the portable Triton kernel; {record.subject} "
                    f"runs on the CPU on request (backend={record.name!r})")
    if spec.device_type == "cuda" and kernel.gpus is not None and not kernel.gpus.admits(spec.capability):
        return kernel.gpus.refusal(spec.capability)
    if spec.device_type == "cuda" and spec.capability is not None:
        need = dict(kernel.min_triton).get(spec.capability[0])
        if need is not None and triton_version() < need:
            have = ".".join(map(str, triton_version()))
            return (f"Triton {have} cannot build {kernel.name} for {_sm(spec.capability)} (Triton "
                    f"{need[0]}.{need[1]} or newer can): use bits=8 or upgrade Triton")
    if record.head_dims is not None and spec.head_dim not in record.head_dims:
        return f"head dim {spec.head_dim} ({record.subject}: head dim {_or(record.head_dims)} only)"
    if record.dtypes is not None and spec.dtype not in record.dtypes:
        names = [str(dtype).replace("torch.", "") for dtype in record.dtypes]
        return f"dtype {spec.dtype} ({record.subject}: {_or(names)} only)"
    if requested == "auto" and record.auto_bits is not None and spec.bits not in record.auto_bits:
        return record.auto_refusal
    for need in record.needs:
        why = REQUIREMENTS[need](spec)
        if why:
            return why
    return None


def _cubins_refusal(spec: CallSpec) -> Optional[str]:
    from .precompiled.specs import TORCH_TO_TRITON

    ok, why, configs = precompiled_status(tuple(spec.capability))
    if not ok:
        return why
    kernel = cubins_kernel(tuple(spec.capability))
    if spec.pv_int8 and kernel != "vc_attention_mma_fwd_kernel":
        return (f"the cubins for {_sm(spec.capability)} run the portable kernel, which has no INT8 P.V path "
                f"(pv_format='int8': the mma.sync kernel's cubins, sm_89 / sm_120)")
    if (spec.head_dim, TORCH_TO_TRITON[str(spec.dtype).replace("torch.", "")]) not in configs:
        return f"the cubins for this GPU have no kernel for head dim {spec.head_dim} with {spec.dtype}"
    return None


# What a record can need, probed after its constraints (through the module's names, so a test can
# replace triton_status and the rest).
def _reason(status) -> Optional[str]:
    return None if status[0] else status[1]


REQUIREMENTS = {
    "triton": lambda spec: _reason(triton_status()),  # the pre-pass and the portable kernels
    "gluon": lambda spec: _reason(gluon_status()),
    "mma": lambda spec: _reason(mma_status()),
    "cubins": _cubins_refusal,  # the attention cubins for this GPU, head dim and dtype
}


# --- run functions: each kernel's own entry, called with the registry's one signature ------------

def _fused(fn, *, with_expcast=True):
    """A fused-kernel entry fn(q, k, v, out, *, v_smooth, [expcast,] perm, sm_scale, key_bias)."""

    def run(q, k, v, out, *, bits, v_smooth, expcast, perm, sm_scale, key_bias, attn_mask, is_causal, lse=None,
            pv_int8=False):
        options = dict(v_smooth=v_smooth, perm=perm, sm_scale=sm_scale, key_bias=key_bias)
        if with_expcast:
            options["expcast"] = expcast
        if lse is not None:  # only asked of the kernels whose record says lse=True
            options["lse"] = lse
        if pv_int8:  # likewise pv_int8=True
            options["pv_int8"] = True
        fn(q, k, v, out, **options)

    return run


def _load_gluon():
    from .gluon import gluon_vc_attention

    return _fused(gluon_vc_attention)


def _load_mma():
    from .triton.attention_mma import mma_vc_attention

    return _fused(mma_vc_attention)


def _load_precompiled():
    from .precompiled import precompiled_vc_attention

    return _fused(precompiled_vc_attention)


def _load_triton():
    from .triton.attention import triton_vc_attention

    return _fused(triton_vc_attention)


def _load_triton_fp4():
    from .triton.attention_fp4 import triton_vc_attention_fp4

    return _fused(triton_vc_attention_fp4, with_expcast=False)  # P is NVFP4: no ExpCast


def _load_reference():
    from .reference.attention import reference_vc_attention
    from .reference.workstation import workstation_vc_attention

    def run(q, k, v, out, *, bits, v_smooth, expcast, perm, sm_scale, key_bias, attn_mask, is_causal, lse=None,
            pv_int8=False):
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        perm = None if perm is None else perm.long()  # torch.gather: int64 indices
        if pv_int8:  # the INT8 P.V path as the RTX kernel computes it
            if lse is not None:
                raise NotImplementedError("the reference of the INT8 P.V path does not write the log-sum-exp")
            out.copy_(workstation_vc_attention(q, k, v, v_smooth=v_smooth, perm=perm, sm_scale=sm_scale,
                                               key_bias=key_bias, pv_accumulation="int8", dtype=dtype))
            return
        result = reference_vc_attention(q, k, v, bits=bits, v_smooth=v_smooth, expcast=expcast, perm=perm,
                                        sm_scale=sm_scale, key_bias=key_bias, dtype=dtype, return_lse=lse is not None)
        if lse is not None:
            result, row_lse = result
            lse.copy_(row_lse)
        out.copy_(result)

    return run


def _load_sdpa():
    def run(q, k, v, out, *, bits, v_smooth, expcast, perm, sm_scale, key_bias, attn_mask, is_causal, lse=None,
            pv_int8=False):
        mask = attn_mask if attn_mask is not None else key_bias
        out.copy_(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=sm_scale))

    return run


def _load_triton_kmeans():
    from .triton.kmeans import kmeans_triton

    return kmeans_triton


def _load_precompiled_kmeans():
    from .precompiled import precompiled_kmeans

    return precompiled_kmeans


def _precompiled_kmeans_refusal(x) -> Optional[str]:
    from .precompiled import kmeans_available

    return kmeans_available(x)


def _load_reference_kmeans():
    from .reference.kmeans import kmeans_reference

    def kmeans(x, centroids, iters):
        """x [B, H, N, D], centroids [B*H, C, D] -> (labels, centroids, order), as kmeans_triton."""
        B, H, N, D = x.shape
        labels, centroids = kmeans_reference(x.reshape(B * H, N, D), centroids.shape[1], iters, init=centroids)
        return labels, centroids, torch.sort(labels, dim=-1, stable=True).indices

    return kmeans


FP8_GPUS = GPUs(minimum=(8, 9), need="FP8 tensor cores need sm_89 or newer")
EXPCAST_MAJORS = (9, 10)  # ExpCast pays where the exp unit limits as much as the tensor cores

RECORDS = (
    Backend(
        name="gluon", subject="the Hopper kernel",
        description="the 8-bit Hopper kernel (Gluon: TMA ring, asynchronous wgmma) behind the Triton pre-pass",
        kernels=(Kernel(8, _load_gluon, "8-bit Hopper kernel, P by {p}",
                        GPUs(exact=((9, 0),), need="the Gluon kernel uses Hopper's wgmma and TMA (sm_90)"),
                        lse=True),),
        cpu_hint=" (Gluon kernels do not run in the interpreter)", head_dims=(128,),
        needs=("triton", "gluon"), expcast_majors=(9,)),
    Backend(
        name="mma", subject="the mma.sync kernel",
        description="the 8-bit kernel for warp-level mma.sync GPUs (RTX 4090, RTX 5090, RTX PRO 6000)",
        kernels=(Kernel(8, _load_mma, "8-bit mma.sync kernel, P by {p}",
                        GPUs(exact=((8, 9), (12, 0)),
                             need="the mma.sync kernel is built for sm_89 (RTX 4090) and sm_120 (RTX 5090 / "
                                  "RTX PRO 6000)"), lse=True, pv_int8=True, pv_int8_default=True),),
        interpreter="request",
        cpu_hint=" (set TRITON_INTERPRET=1 and backend='mma' to run it on the CPU, slowly)",
        needs=("triton", "mma")),
    Backend(
        name="precompiled", subject="the cubins",
        description="the 8-bit kernels built ahead of time for this GPU (the mma.sync kernel on sm_89 / sm_120, "
                    "the portable one on sm_90 / sm_100), launched through the CUDA driver",
        # (the INT8 P.V path by default where the cubins are the mma.sync kernel's: _cubins_refusal)
        kernels=(Kernel(8, _load_precompiled, "8-bit, P by {p}", FP8_GPUS, pv_int8=True, pv_int8_default=True),),
        cpu_hint=" (cubins run through the CUDA driver)", needs=("cubins",), expcast_majors=EXPCAST_MAJORS,
        kmeans=_load_precompiled_kmeans, kmeans_refusal=_precompiled_kmeans_refusal),
    Backend(
        name="triton", subject="the Triton kernels",
        description="the portable Triton kernels: 8-bit on sm_89+, 4-bit NVFP4 on sm_100 / sm_120",
        kernels=(
            Kernel(8, _load_triton, "8-bit, P by {p}", FP8_GPUS, lse=True),
            Kernel(4, _load_triton_fp4, "4-bit NVFP4, P by exp2 + NVFP4 per 16 keys", name="the 4-bit NVFP4 kernel",
                   gpus=GPUs(majors=(10, 12), hint=": use bits=8",
                             need="the 4-bit NVFP4 kernel needs FP4 tensor cores (sm_100 B200, sm_120 RTX 5090 / "
                                  "RTX PRO 6000)"),
                   # sm_100 fails in TritonGPUOptimizeAccumulatorInit under 3.6 and 3.8; sm_120 builds with 3.6.
                   min_triton=((10, (3, 9)), (12, (3, 6)))),
        ),
        interpreter="auto",
        cpu_hint=" (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)",
        needs=("triton",), expcast_majors=EXPCAST_MAJORS, kmeans=_load_triton_kmeans, kmeans_needs=("triton",)),
    Backend(
        name="reference", subject="the reference",
        description="the readable PyTorch method: any device, slow",
        kernels=tuple(Kernel(bits, _load_reference, lse=True, pv_int8=bits == 8) for bits in (8, 4, 16)),
        cuda_only=False, head_dims=None, dtypes=None, auto_bits=(16,),
        auto_refusal="the readable reference is slow: used on request (backend='reference') or for bits=16",
        expcast_majors=EXPCAST_MAJORS, kmeans=_load_reference_kmeans),
    Backend(
        name="sdpa", subject="torch SDPA",
        description="torch's scaled_dot_product_attention: not low-bit, the fallback",
        kernels=tuple(Kernel(bits, _load_sdpa) for bits in SUPPORTED_BITS),
        cuda_only=False, head_dims=None, dtypes=None, per_key_masks_only=False, low_bit=False),
)
REGISTRY = {record.name: record for record in RECORDS}
BACKENDS = tuple(REGISTRY)


def expcast_default(spec: CallSpec) -> bool:
    """Whether the portable 8-bit kernels make P by ExpCast on this GPU by default (sm_90, sm_100)."""
    return REGISTRY["triton"].expcast_default(spec.capability)


@functools.lru_cache(maxsize=None)
def _run_function(name: str, bits: int) -> Callable:
    return REGISTRY[name].kernel(bits).load()


def run(name: str, q, k, v, out, *, bits, **options) -> None:
    """Run backend `name`'s kernel for `bits` on [B, H, N, D] views, writing out (what api's custom op
    calls once the registry has chosen)."""
    _run_function(name, bits)(q, k, v, out, bits=bits, **options)


# --- the decision ----------------------------------------------------------------------------------

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
    pv_int8: bool = False

    @property
    def fallback(self) -> bool:
        return not self.low_bit

    def __str__(self) -> str:
        head = f"VC-Attention backend: {self.backend}"
        record = REGISTRY.get(self.backend)
        kernel = record.kernel(self.bits) if record is not None and self.bits is not None else None
        if kernel is not None and kernel.label:
            p = "ExpCast" if self.expcast else "exp2 + cast"
            if self.pv_int8:
                p = "exp2 + INT8 per key tile, V's residual INT8 per block"
            head += f" ({kernel.label.format(p=p)})"
        lines = [head] + [f"  {name} refused: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


_logged = set()


def log_once(message: str, level=logging.WARNING) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def _int8_by_default(record: Backend, spec: CallSpec, requested: str, expcast: Optional[bool]) -> bool:
    """pv_format="auto": whether the chosen backend runs the INT8 P.V path. Where its kernel makes
    that path its default (the mma.sync kernel and its cubins: RTX 4090 / 5090 / PRO 6000; 5-9 dB
    closer to exact attention than FP8 P.V on clean, peaked and noisy real-clip probes, and as fast
    on the proxy: FIDELITY.md / BENCHMARKS.md) and it can run it for this call; not with ExpCast
    asked for (its bytes are E4M3) and not for other bit widths."""
    kernel = record.kernel(spec.bits)
    if spec.bits != 8 or expcast or kernel is None or not kernel.pv_int8_default:
        return False
    return refusal(record, replace(spec, pv_int8=True, pv_auto=False), requested) is None


def choose_backend(spec: CallSpec, requested: str = "auto", expcast: Optional[bool] = None,
                   log_fallback: bool = True) -> BackendDecision:
    """Pick the backend for a call. An explicit request that cannot run raises with the reason;
    "auto" falls back to SDPA and logs why once (log_fallback=False: only the decision)."""
    if requested not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {requested!r}")
    if spec.bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {spec.bits}")
    reasons = {}
    for record in RECORDS if requested == "auto" else (REGISTRY[requested],):
        why = refusal(record, spec, requested)
        if why is not None:
            reasons[record.name] = why
            continue
        use_expcast = record.expcast_default(spec.capability) if expcast is None else bool(expcast)
        if not record.low_bit and requested == "auto" and log_fallback:
            log_once(f"VC-Attention falls back to {record.subject} (not low-bit): "
                     + "; ".join(f"{k}: {v}" for k, v in reasons.items()))
        pv_int8 = spec.pv_int8 or (spec.pv_auto and _int8_by_default(record, spec, requested, expcast))
        return BackendDecision(record.name, low_bit=record.low_bit, requested=requested, reasons=reasons,
                               expcast=use_expcast and spec.bits == 8 and record.low_bit and not pv_int8,
                               bits=spec.bits if record.low_bit else None, pv_int8=pv_int8)
    if requested == "auto":  # only a call that asks for what SDPA has not (the LSE, INT8 P.V) gets here
        raise RuntimeError("no VC-Attention backend can run this call: "
                           + "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    raise RuntimeError(f"VC-Attention backend {requested!r} cannot run this call: {reasons[requested]}")


# --- the k-means step of plan_v_smooth ------------------------------------------------------------

KMEANS_BACKENDS = tuple(record.name for record in RECORDS if record.kmeans is not None)


def kmeans_refusal(record: Backend, x: torch.Tensor, requested: str = "auto") -> Optional[str]:
    """Why `record`'s k-means cannot group x ([B, H, N, D] value tokens), or None. A GPU backend's
    k-means runs under the interpreter only on request (backend='triton')."""
    if record.cuda_only and x.device.type != "cuda":
        if not (record.interpreter and interpreting() and requested == record.name):
            return f"tensors are on {x.device.type}, not a CUDA GPU{record.cpu_hint}"
    for need in record.kmeans_needs:
        why = REQUIREMENTS[need](None)
        if why:
            return why
    if record.kmeans_refusal is not None and x.device.type == "cuda":
        return record.kmeans_refusal(x)
    return None


def choose_kmeans(x: torch.Tensor, requested: str = "auto") -> tuple:
    """(backend name, k-means function, reasons of those refused) for plan_v_smooth. The function:
    kmeans(x [B, H, N, D], centroids [B*H, C, D] fp32, iters) -> (labels, centroids, order)."""
    if requested not in ("auto",) + KMEANS_BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + KMEANS_BACKENDS}, got {requested!r}")
    reasons = {}
    for name in KMEANS_BACKENDS if requested == "auto" else (requested,):
        record = REGISTRY[name]
        why = kmeans_refusal(record, x, requested)
        if why is None:
            return name, record.kmeans(), reasons
        reasons[name] = why
    raise RuntimeError(f"VC-Attention k-means backend {requested!r} cannot run here: {reasons[requested]}")
