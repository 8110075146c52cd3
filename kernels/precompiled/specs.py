"""What is precompiled: the kernels, their variants, and the launch-time assumptions (Triton-free).

A variant is one compiled specialisation of a kernel: its pointer types (None for an absent
pointer, compiled as a constexpr None), its constexprs, num_warps and num_stages. The host code
(kernels/pipeline.py) calls a launcher with the same names; the loader finds the cubin by
variant_key() of what it was given, so build and run agree by construction.

Specialisations mirror what Triton's JIT does for typical calls, so a cubin runs the code the JIT
would have compiled: every pointer 16-byte aligned ("tt.divisibility" 16), the last-dim strides
equal to 1 (a constexpr, as the JIT makes an int argument equal to 1), the other strides multiples
of 16 (always true for head dims 64 and 128 with a unit last-dim stride). The loader checks these
at launch; the precompiled pipeline makes an input contiguous first when it does not meet them.
"""

import functools
import hashlib
import json
import pathlib
from itertools import product

from .. import pipeline
from ..pipeline import (KMEANS_BLOCK_C, KMEANS_BLOCK_R, KMEANS_BLOCK_T, KMEANS_DOT_PRECISION, PORTABLE_BLOCK_M,
                        PORTABLE_NUM_STAGES, PORTABLE_NUM_WARPS, PORTABLE_PV_PERM, QK_QUANT_WARPS, V_PREPASS_WARPS,
                        V_SCALE_BLOCKS, V_STATS_BLOCK_D)
from ..reference.expcast import P_BETA, p_format_of
from ..pipeline_mma import (MMA_BLOCK_M, MMA_BLOCK_N, MMA_INT8_BLOCK_N, MMA_INT8_RUN_TILES, MMA_NUM_STAGES,
                            MMA_NUM_WARPS, MMA_RUN_TILES)

# torch dtype name -> Triton type string.
TORCH_TO_TRITON = {
    "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1",
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}

HEAD_DIMS = pipeline.HEAD_DIMS
IO_DTYPES = tuple(TORCH_TO_TRITON[str(d).replace("torch.", "")] for d in pipeline.IO_DTYPES)  # "bf16", ...
DEFAULT_ARCHS = (89, 90, 100, 120)

# The claim, as data: which backend record's attention kernel the `precompiled` backend carries as
# cubins, for which architectures (the pre-pass and k-means kernels are shared by both and built
# for every architecture). sm_89 / sm_120 launch the mma.sync kernel, as "auto" does with Triton;
# sm_90 / sm_100 the portable kernel. The build, the loader, the tests and CI's wheel check read it.
RECORD_ARCHS = {"mma": (89, 120), "triton": (90, 100)}
# Registry records that run through Triton's JIT only, and why.
JIT_ONLY = {
    "gluon": "its host code builds TMA descriptors for each call's tensors and its PTX passes through a "
             "rewrite stage (kernels/gluon/ptx_pass.py): not a plain cubin launch; without Triton an sm_90 "
             "GPU runs the precompiled portable kernel",
}
# The PTX fallback: the oldest target's PTX (.target sm_89, not arch-specific like sm_90a), which the
# CUDA driver JIT-compiles for a GPU newer than sm_89 that has no cubins of its own.
PTX_ARCHS = (89,)
MANIFEST_FORMAT = 2  # 2: per-kernel source hashes; the loader refuses other formats (rebuild)
PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]  # the folder of the vc_attention package


def _stride_rules(prefix_names):
    *others, last = prefix_names
    return {"one": (last,), "div16": tuple(others)}


# Per kernel: module (for the build), pointer arguments, launch assumptions; `record`: the registry
# record whose attention kernel it is (RECORD_ARCHS says where), None for the shared pre-pass / k-means.
KERNELS = {
    "vc_attention_fwd_kernel": dict(
        module="vc_attention.kernels.triton.attention", record="triton",
        pointers=("Q", "QS", "QBAD", "K", "KS", "KBAD", "VT", "ONES", "VS", "MU", "BIAS", "O", "LSE"),
        one=("stride_od",), div16=("stride_ob", "stride_oh", "stride_om", "NPAD")),
    # As compile_mma_attention (kernels/triton/attention_mma.py) specialises it.
    "vc_attention_mma_fwd_kernel": dict(
        module="vc_attention.kernels.triton.attention_mma", record="mma",
        pointers=("Q", "QS", "QBAD", "K", "KS", "KBAD", "VT", "VS", "MU", "VCS", "VRATIO", "BIAS", "O", "LSE"),
        one=("stride_od",), div16=("stride_ob", "stride_oh", "stride_om", "NPAD")),
    "quantize_qk_block_kernel": dict(
        module="vc_attention.kernels.triton.prepass",
        pointers=("X", "PERM", "MEAN", "CODES", "SCALES", "BAD_ROWS"),
        **_stride_rules(("stride_xb", "stride_xh", "stride_xn", "stride_xd"))),
    "v_block_stats_kernel": dict(
        module="vc_attention.kernels.triton.prepass",
        pointers=("V", "PERM", "MU", "AMAX", "BAD"),
        **_stride_rules(("stride_vb", "stride_vb_h", "stride_vn", "stride_vd"))),
    "v_scale_kernel": dict(
        module="vc_attention.kernels.triton.prepass",
        pointers=("AMAX", "BAD", "SCALE", "SCALE_OUT"), one=(), div16=()),
    "v_quantize_kernel": dict(
        module="vc_attention.kernels.triton.prepass",
        pointers=("V", "PERM", "MU", "SCALE", "VT", "MU_SCALED", "MU_TF32"),
        one=("stride_vd",), div16=("stride_vb", "stride_vb_h", "stride_vn", "NPAD")),
    "kmeans_assign_kernel": dict(
        module="vc_attention.kernels.triton.kmeans",
        pointers=("X", "C", "CNORM", "LABELS"),
        **_stride_rules(("stride_xb", "stride_xh", "stride_xn", "stride_xd"))),
    "kmeans_update_kernel": dict(
        module="vc_attention.kernels.triton.kmeans",
        pointers=("X", "ORDER", "STARTS", "C_OLD", "C_NEW"),
        **_stride_rules(("stride_xb", "stride_xh", "stride_xn", "stride_xd"))),
}


def kernel_archs(kernel):
    """The architectures a kernel is precompiled for."""
    record = KERNELS[kernel].get("record")
    return DEFAULT_ARCHS if record is None else RECORD_ARCHS[record]


def attention_kernel(arch):
    """The attention kernel the precompiled backend launches on this architecture (None: none claimed)."""
    return next((k for k in KERNELS if KERNELS[k].get("record") and arch in kernel_archs(k)), None)


def source_files(kernel, root=PACKAGE_ROOT):
    """The Triton source a kernel is built from: its module and the kernels/triton modules it imports,
    transitively (every @triton.jit function it can call lives there), as package-relative paths."""
    import ast

    triton_dir = root / "kernels" / "triton"
    todo = [KERNELS[kernel]["module"].split(".")[-1]]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or not (triton_dir / f"{name}.py").is_file():
            continue
        seen.add(name)
        tree = ast.parse((triton_dir / f"{name}.py").read_bytes())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y / from . import x
                todo += [node.module] if node.module else [a.name for a in node.names]
    return sorted(f"kernels/triton/{name}.py" for name in seen)


@functools.lru_cache(maxsize=None)
def source_hash(kernel, root=PACKAGE_ROOT):
    """sha256 of the kernel's source files (source_files), line endings normalised (a Windows checkout
    with CRLF is the same source). The manifest records it; the loader compares it before a launch."""
    h = hashlib.sha256()
    for rel in source_files(kernel, root):
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()


def variant_key(kernel, pointer_types, constexprs, num_warps, num_stages):
    """The one string that names a variant, at build and at launch."""
    return json.dumps({"kernel": kernel, "pointers": dict(sorted(pointer_types.items())),
                       "constexprs": dict(sorted(constexprs.items())), "num_warps": int(num_warps),
                       "num_stages": None if num_stages is None else int(num_stages)},
                      sort_keys=True, separators=(",", ":"))


def _variant(kernel, pointers, constexprs, num_warps, num_stages, tags):
    return dict(kernel=kernel, pointers=pointers, constexprs=constexprs, num_warps=num_warps,
                num_stages=num_stages, tags=tags)


def variants(arch=None):
    """Every variant the 8-bit path launches for head dims 64/128 and bf16/fp16/fp32 tensors
    (INT8 Q/K, the dispatcher's format; the E4M3 Q/K option stays on the JIT); with `arch`, those
    built for that architecture (kernel_archs)."""
    out = []
    for D, io, has_mean, has_bias, expcast in product(HEAD_DIMS, IO_DTYPES, (True, False), (True, False),
                                                       (True, False)):
        out.append(_variant(
            "vc_attention_fwd_kernel",
            dict(Q="i8", QS="fp32", QBAD="i8", K="i8", KS="fp32", KBAD="i8", VT="fp8e4nv", ONES="fp8e4nv",
                 VS="fp32", MU="fp32" if has_mean else None, BIAS="fp32" if has_bias else None, O=io,
                 LSE=None),  # the LSE output (ring attention) stays on the JIT
            dict(HEAD_DIM=D, BLOCK_M=PORTABLE_BLOCK_M, BLOCK_N=128, QK_BLK=128, V_BLK=128, HAS_MEAN=has_mean,
                 HAS_BIAS=has_bias, EXPCAST=expcast, BETA=P_BETA[p_format_of(None, expcast)],
                 SOFTWARE_ROUNDING=False, QK_FP8=False, PV_IMPRECISE_ACC=128 if has_mean else 32,
                 PV_PERM=PORTABLE_PV_PERM, P_E5M2=p_format_of(None, expcast) == "e5m2"),
            PORTABLE_NUM_WARPS, PORTABLE_NUM_STAGES, dict(head_dim=D, dtype=io, role="attention")))
        # The mma.sync kernel as its host code launches it on a GPU (attention_mma.py's defaults).
        out.append(_variant(
            "vc_attention_mma_fwd_kernel",
            dict(Q="i8", QS="fp32", QBAD="i8", K="i8", KS="fp32", KBAD="i8", VT="fp8e4nv", VS="fp32",
                 MU="fp32" if has_mean else None, VCS=None, VRATIO=None, BIAS="fp32" if has_bias else None,
                 O=io, LSE=None),
            dict(HEAD_DIM=D, BLOCK_M=MMA_BLOCK_M, BLOCK_N=MMA_BLOCK_N, RUN_TILES=MMA_RUN_TILES, QK_BLK=128,
                 V_BLK=128, HAS_MEAN=has_mean, HAS_BIAS=has_bias, EXPCAST=expcast, BETA=-0.35,
                 SOFTWARE_ROUNDING=False, PV_ACC16=True, ROWSUM_CUDA=False),
            MMA_NUM_WARPS, MMA_NUM_STAGES, dict(head_dim=D, dtype=io, role="attention")))
        if not expcast:  # its INT8 P.V path (the default on these GPUs; P by exp2 only), its own tiles
            out.append(_variant(
                "vc_attention_mma_fwd_kernel",
                dict(Q="i8", QS="fp32", QBAD="i8", K="i8", KS="fp32", KBAD="i8", VT="i8", VS="fp32",
                     MU="fp32" if has_mean else None, VCS="i32", VRATIO="fp32",
                     BIAS="fp32" if has_bias else None, O=io, LSE=None),
                dict(HEAD_DIM=D, BLOCK_M=MMA_BLOCK_M, BLOCK_N=MMA_INT8_BLOCK_N, RUN_TILES=MMA_INT8_RUN_TILES,
                     QK_BLK=128, V_BLK=128, HAS_MEAN=has_mean, HAS_BIAS=has_bias, EXPCAST=False, BETA=-0.35,
                     SOFTWARE_ROUNDING=False, PV_ACC16=True, ROWSUM_CUDA=False, PV_INT8=True, Q_TOKEN=True),
                MMA_NUM_WARPS, MMA_NUM_STAGES, dict(head_dim=D, dtype=io, role="attention", pv="int8")))
    for D, io in product(HEAD_DIMS, IO_DTYPES):
        tags = dict(head_dim=D, dtype=io)
        for has_perm, has_mean in ((False, False), (True, True), (False, True)):
            out.append(_variant(
                "quantize_qk_block_kernel",
                dict(X=io, PERM="i64" if has_perm else None, MEAN="fp32" if has_mean else None,
                     CODES="i8", SCALES="fp32", BAD_ROWS="i8"),
                dict(HEAD_DIM=D, BLOCK=128, HAS_PERM=has_perm, HAS_MEAN=has_mean, FP8=False,
                     SOFTWARE_ROUNDING=False), QK_QUANT_WARPS, None, dict(tags, role="prepass")))
        # Q with one scale per token: the mma.sync kernel's INT8 P.V path
        out.append(_variant(
            "quantize_qk_block_kernel",
            dict(X=io, PERM=None, MEAN=None, CODES="i8", SCALES="fp32", BAD_ROWS="i8"),
            dict(HEAD_DIM=D, BLOCK=128, HAS_PERM=False, HAS_MEAN=False, FP8=False, SOFTWARE_ROUNDING=False,
                 PER_ROW=True), QK_QUANT_WARPS, None, dict(tags, role="prepass", pv="int8")))
        for has_perm, v_smooth in product((True, False), (True, False)):
            ptr = dict(V=io, PERM="i64" if has_perm else None, MU="bf16" if v_smooth else None)
            out.append(_variant("v_block_stats_kernel", dict(ptr, AMAX="fp32", BAD="i8"),
                                dict(HEAD_DIM=D, BLOCK=128, BLOCK_D=min(V_STATS_BLOCK_D, D), HAS_PERM=has_perm,
                                     V_SMOOTH=v_smooth),
                                V_PREPASS_WARPS, None, dict(tags, role="prepass")))
            # MU_TF32: the Hopper Gluon kernel's operand, never asked for on the precompiled path.
            # V^T in key order for the mma.sync kernel, in the P.V operand's order for the portable one.
            for pv_perm in sorted({False, PORTABLE_PV_PERM}):
                out.append(_variant("v_quantize_kernel", dict(ptr, SCALE="fp32", VT="fp8e4nv",
                                                              MU_SCALED="fp32" if v_smooth else None, MU_TF32=None),
                                    dict(HEAD_DIM=D, BLOCK=128, HAS_PERM=has_perm, V_SMOOTH=v_smooth,
                                         SOFTWARE_ROUNDING=False, PV_PERM=pv_perm), V_PREPASS_WARPS, None,
                                    dict(tags, role="prepass")))
            # INT8 codes with V's scale per (block, channel): the mma.sync kernel's INT8 P.V path
            out.append(_variant("v_quantize_kernel", dict(ptr, SCALE="fp32", VT="i8",
                                                          MU_SCALED="fp32" if v_smooth else None, MU_TF32=None),
                                dict(HEAD_DIM=D, BLOCK=128, HAS_PERM=has_perm, V_SMOOTH=v_smooth,
                                     SOFTWARE_ROUNDING=False, PV_PERM=False, INT8=True, SCALE_PER_BLOCK=True),
                                V_PREPASS_WARPS, None, dict(tags, role="prepass", pv="int8")))
        if io == IO_DTYPES[0]:  # its operands are the pre-pass's own fp32 / int8 whatever V's dtype
            out.append(_variant("v_scale_kernel", dict(AMAX="fp32", BAD="i8", SCALE="fp32", SCALE_OUT="fp32"),
                                dict(HEAD_DIM=D, BLOCK_B=V_SCALE_BLOCKS), V_PREPASS_WARPS, None,
                                dict(head_dim=D, role="prepass")))
        out.append(_variant("kmeans_assign_kernel", dict(X=io, C="fp32", CNORM="fp32", LABELS="i64"),
                            dict(HEAD_DIM=D, BLOCK_T=KMEANS_BLOCK_T, BLOCK_C=KMEANS_BLOCK_C,
                                 DOT_PRECISION=KMEANS_DOT_PRECISION), 4, None,
                            dict(tags, role="kmeans")))
        out.append(_variant("kmeans_update_kernel",
                            dict(X=io, ORDER="i64", STARTS="i64", C_OLD="fp32", C_NEW="fp32"),
                            dict(HEAD_DIM=D, BLOCK_R=KMEANS_BLOCK_R), 4, None, dict(tags, role="kmeans")))
    if arch is not None:
        out = [v for v in out if arch in kernel_archs(v["kernel"])]
    for v in out:
        v["key"] = variant_key(v["kernel"], v["pointers"], v["constexprs"], v["num_warps"], v["num_stages"])
        v["label"] = variant_label(v)
    return out


def variant_label(v):
    """A readable one-line name: kernel, then NAME=value for every constexpr and pointer type, sorted."""
    items = {**v["constexprs"], **v["pointers"]}
    return v["kernel"] + " " + " ".join(f"{k}={items[k]}" for k in sorted(items))
