"""The attention-output error of every 8-bit path split into its Q/K, P and V terms, on probes from
real clips at several head temperatures and diffusion-noise levels (FIDELITY.md, "Error split").

    python benchmarks/fidelity/error_split.py                    # CPU, ~10 min on 2 cores
    python benchmarks/fidelity/error_split.py --quick            # smoke, ~1 min
    python benchmarks/fidelity/error_split.py --device cuda --latent-frames 21 --patch 8 \\
        --heads 8 --query-blocks 8 --ck-kernel --tag h200        # the H200 variant, longer sequences,
                                                                 # with comfy-kitchen's own kernel

Per probe head (query subset: contiguous 128-row blocks of the full sequence, all keys), against
float64 exact attention, for each configuration of ``vc_attention.kernels.fidelity.simulate``
(``SPLIT_CONFIGS`` and the levers below), the split O_3 - O_ref = E_QK + E_P + E_V
(simulate.error_split's docstring): SQNR of the whole error and of each term alone, their shares.

Probes (``--probes``): ``clean`` (the builder's defaults), ``broad`` / ``peaked`` (every head's QK
gain times 0.6 / 1.6: the score spread times 0.36 / 2.56), ``noise50`` / ``noise90`` (hidden state
mixed with Gaussian noise, x_t = (1 - t) x0 + t eps at t = 0.5 / 0.9).

Writes ``benchmarks/results/fidelity_error_split[_TAG].csv`` (one row per probe, clip, head,
configuration) and prints mean tables.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
if importlib.util.find_spec("vc_attention") is None:  # a plain checkout: the repository is the package
    _spec = importlib.util.spec_from_file_location("vc_attention", ROOT / "__init__.py",
                                                   submodule_search_locations=[str(ROOT)])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["vc_attention"] = _mod
    _spec.loader.exec_module(_mod)

from vc_attention.kernels.fidelity.probes import CLIPS, build_probe  # noqa: E402
from vc_attention.kernels.fidelity.simulate import (  # noqa: E402
    SPLIT_CONFIGS, config_with, error_split, query_blocks, write_csv)
from vc_attention.kernels.plan import plan_v_smooth  # noqa: E402

PROBES = {"clean": {}, "broad": {"gain_scale": 0.6}, "peaked": {"gain_scale": 1.6},
          "noise50": {"hidden_noise": 0.5}, "noise90": {"hidden_noise": 0.9}}

# Each lever alone on the library's default (vs_expcast), then combinations. Kernel costs: FIDELITY.md.
LEVERS = {
    "d+q_token": config_with("vs_expcast", q_group=1),
    "d+q_ck": config_with("vs_expcast", q_group="ck"),
    "d+k_token": config_with("vs_expcast", k_group=1),
    "d+k_16": config_with("vs_expcast", k_group=16),
    "d+k_ck": config_with("vs_expcast", k_group="ck"),
    "d+q_smooth": config_with("vs_expcast", q_smooth=True),
    "d+hadamard": config_with("vs_expcast", hadamard=True),
    "d+v_block": config_with("vs_expcast", v="e4m3_block"),
    "d+tail": config_with("vs_expcast", p="expcast_tail"),
    "d+exact_max": config_with("vs_expcast", ref_point="max"),
    # P in E5M2 (kernels/reference/expcast.py): 4 codes per octave, no underflow of a long row's tail
    "d+p_e5m2": config_with("vs_expcast", p="expcast_e5m2"),
    "vs_exp2+p_e5m2": config_with("vs_exp2", p="exp2_e5m2"),
    "d+p_e5m2+v_x2": config_with("vs_expcast", p="expcast_e5m2", v="e4m3x2"),
    "vs_exp2+p_e5m2+v_x2": config_with("vs_exp2", p="exp2_e5m2", v="e4m3x2"),
    "vs_exp2+v_x2": config_with("vs_exp2", v="e4m3x2"),
    # P's reference point per tile (each tile's own row max) instead of the running max
    "d+p_tile": config_with("vs_expcast", ref_point="tile_grid"),
    "d+tail+p_tile": config_with("vs_expcast", p="expcast_tail", ref_point="tile_grid"),
    "d+p_e5m2+p_tile": config_with("vs_expcast", p="expcast_e5m2", ref_point="tile_grid"),
    "d+tail+p_tile+v_x2": config_with("vs_expcast", p="expcast_tail", ref_point="tile_grid", v="e4m3x2"),
    "d+p_e5m2+p_tile+v_x2": config_with("vs_expcast", p="expcast_e5m2", ref_point="tile_grid", v="e4m3x2"),
    "vs_exp2+p_tile+v_x2": config_with("vs_exp2", ref_point="tile", v="e4m3x2"),
    "plain8+p_e5m2": config_with("plain8", p="exp2_e5m2"),
    "d+q_token+p_e5m2": config_with("vs_expcast", q_group=1, p="expcast_e5m2"),
    "d+q_token+tail": config_with("vs_expcast", q_group=1, p="expcast_tail"),  # reference.FIDELITY_8BIT
    "d+q_token+k_ck": config_with("vs_expcast", q_group=1, k_group="ck"),
    "d+q_token+q_smooth": config_with("vs_expcast", q_group=1, q_smooth=True),
    "d+q_token+k_ck+q_smooth": config_with("vs_expcast", q_group=1, k_group="ck", q_smooth=True),
    "d+q_token+k_ck+q_smooth+tail": config_with("vs_expcast", q_group=1, k_group="ck", q_smooth=True,
                                                p="expcast_tail"),
    "d+q_token+k_ck+q_smooth+tail+v_block": config_with("vs_expcast", q_group=1, k_group="ck", q_smooth=True,
                                                        p="expcast_tail", v="e4m3_block"),
    # informative, not cheap in our kernels: INT8 V needs an INT8 P (no E4M3 byte path, no ExpCast)
    "vs+int8_v+u8_p": config_with("vs_expcast", v="int8", p="u8_tile", ref_point="max", row_sum="fp32"),
    "vs+int8_vblock+u8_p": config_with("vs_expcast", v="int8_block", p="u8_tile", ref_point="max", row_sum="fp32"),
    "plain+int8_vblock+u8_p": config_with("plain8", v="int8_block", p="u8_tile", row_sum="fp32"),
    # the workstation kernel's INT8 P.V path (kernels/reference/workstation.py, pv_accumulation="int8"):
    # V's INT8 scale per (128-row block, channel), P against each 64-key tile's row max, the row sum
    # of the same bytes; then the same with P per 128-key tile (the kernel's block_n=128)
    "vs+int8_vblock+u8_p64": config_with("vs_expcast", v="int8_block", p="u8_tile", ref_point="max",
                                         row_sum="same", block_n=64),
    "vs+int8_vblock+u8_p128": config_with("vs_expcast", v="int8_block", p="u8_tile", ref_point="max",
                                          row_sum="same", block_n=128),
    # the same with one Q scale per token (the Q/K term of broad heads)
    "vs+int8_vblock+u8_p64+q_token": config_with("vs_expcast", v="int8_block", p="u8_tile", ref_point="max",
                                                 row_sum="same", block_n=64, q_group=1),
    "vs+int8_vblock+u8_p128+q_token": config_with("vs_expcast", v="int8_block", p="u8_tile", ref_point="max",
                                                  row_sum="same", block_n=128, q_group=1),
    # V per channel (the path's first build), with and without V-Smooth, P per 64 or 128 keys
    "vs+int8_v+u8_p64": config_with("vs_expcast", v="int8", p="u8_tile", ref_point="max", row_sum="same",
                                    block_n=64),
    "plain+int8_v+u8_p64": config_with("plain8", v="int8", p="u8_tile", row_sum="same", block_n=64),
    "vs+int8_v+u8_p128": config_with("vs_expcast", v="int8", p="u8_tile", ref_point="max", row_sum="same",
                                     block_n=128),
    # P on 0..127 (a signed byte, no column-sum correction), per 64-key tile
    "vs+int8_v+u7_p64": config_with("vs_expcast", v="int8", p="u7_tile", ref_point="max", row_sum="same",
                                    block_n=64),
    "d+exact_qk": config_with("vs_expcast", qk="exact"),
}


def _vc(**options):
    def run(q, k, v, plan):
        from vc_attention.kernels import vc_attention

        return vc_attention(q, k, v, plan=plan, **options)
    return run


def _vc_triton(**launch):
    """The portable kernel with launch options the public call does not take (e.g. v_terms)."""
    def run(q, k, v, plan):
        from vc_attention.kernels.triton.attention import triton_vc_attention

        return triton_vc_attention(q, k, v, torch.empty_like(q), perm=plan.perm, **launch)
    return run


def _vc_gluon(**launch):
    """The Hopper kernel with launch options the public call does not take (e.g. expcast_tail)."""
    def run(q, k, v, plan):
        from vc_attention.kernels.gluon import gluon_vc_attention

        return gluon_vc_attention(q, k, v, torch.empty_like(q), perm=plan.perm, **launch)
    return run


_SM89 = {}


def _vc_mma(**options):
    """The RTX kernel (kernels/triton/attention_mma.py) through its sm_89 PTX, JIT-compiled for this GPU
    by the driver: the arithmetic an RTX 4090 / 5090 / PRO 6000 runs (pv_int8: its INT8 P.V path)."""
    def run(q, k, v, plan):
        from vc_attention.kernels.precompiled.ptx import SM89Launcher
        from vc_attention.kernels.triton.attention_mma import mma_vc_attention

        launch = _SM89.setdefault("launch", SM89Launcher())
        return mma_vc_attention(q, k, v, torch.empty_like(q), perm=plan.perm, launch=launch, **options)
    return run


def _vc_fp4(**options):
    """The 4-bit NVFP4 kernel (kernels/triton/attention_fp4.py): natively on sm_100 / sm_120, elsewhere
    its decoded twin (the same products, exactly: the arithmetic of the FP4 tensor cores)."""
    def run(q, k, v, plan):
        from vc_attention.kernels.triton.attention_fp4 import triton_vc_attention_fp4

        v_smooth = options.get("v_smooth", True)
        return triton_vc_attention_fp4(q, k, v, torch.empty(q.shape, dtype=torch.float32, device=q.device),
                                       perm=plan.perm if v_smooth else None, **options)
    return run


def _sage106(q, k, v, plan):
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def _comfy_kitchen(q, k, v, plan):
    from comfy_kitchen.sage_attention import int8_attention

    return int8_attention(q, k, v)


def _sdpa(q, k, v, plan):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


# The real kernels (ours through the public call, "auto" = the Hopper kernel on an H200; the peers).
KERNELS = {"vc8": _vc(bits=8), "vc8_exp2": _vc(bits=8, expcast=False), "vc8_triton": _vc(bits=8, backend="triton"),
           "vc8_tail": _vc_gluon(expcast_tail=True),  # ExpCast with its tail piece (a launch option)
           "vc8_e5m2": _vc_gluon(p_e5m2=True),  # ExpCast's bytes as E5M2 (launch option p_e5m2)
           "vc8_e4m3": _vc_gluon(p_e5m2=False),  # ExpCast's bytes as E4M3 (the paper's)
           # V's residual in two E4M3 terms (launch option v_terms=2): with ExpCast, with exp2 + cast
           "vc8_x2": _vc_gluon(v_terms=2), "vc8_exp2_x2": _vc_gluon(expcast=False, v_terms=2),
           "vc8_triton_x2": _vc_triton(v_terms=2),
           # the RTX kernel through its sm_89 PTX: FP8 P.V; the INT8 P.V path with Q per 128 tokens and
           # P per 64-key, or per 128-key tile; its default (P per 128 keys, one Q scale per token)
           "vc8_mma": _vc_mma(),
           "vc8_mma_int8": _vc_mma(pv_int8=True, block_n=64, run_tiles=2, q_token=False),
           "vc8_mma_int8_bn128": _vc_mma(pv_int8=True, block_n=128, run_tiles=1, q_token=False),
           "vc8_mma_default": _vc_mma(pv_int8=True),
           # the 4-bit kernel: its default (means per 8 tokens, group-scale search), the paper's block
           # mean, plain NVFP4 (no V-Smooth, the usual amax scales), and each part alone
           "vc4": _vc_fp4(), "vc4_block_mean": _vc_fp4(mean_group=128),
           "vc4_plain": _vc_fp4(v_smooth=False, scale_search=""),
           "vc4_amax": _vc_fp4(scale_search=""), "vc4_block_mean_amax": _vc_fp4(mean_group=128, scale_search=""),
           "vc4_plain_search": _vc_fp4(v_smooth=False),
           "sdpa_bf16": _sdpa, "sage106": _sage106, "comfy_kitchen": _comfy_kitchen}


def kernel_rows(names: str, q, k, v, plan, qidx, pname, clip, probe) -> list:
    """SQNR of each real kernel's output on bf16 inputs (as a model feeds them) against float64
    attention of the same bf16 values, per head over the query subset."""
    names = [n for n in names.split(",") if n]
    if not names:
        return []
    q16, k16, v16 = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
    rows = []
    refs = []
    for h in range(q.shape[1]):
        qh, kh, vh = (t[0, h].double() for t in (q16, k16, v16))
        refs.append(torch.softmax(qh[qidx] @ kh.T * qh.shape[-1] ** -0.5, -1) @ vh)
    for name in names:
        out = KERNELS[name](q16, k16, v16, plan).double()
        for h, o_ref in enumerate(refs):
            err = (out[0, h, qidx] - o_ref).pow(2).sum().item()
            ref = o_ref.pow(2).sum().item()
            rows.append({"probe": pname, "clip": clip, "N": probe.n, "head": h, "gain": probe.meta["gain"][h],
                         "config": f"kernel:{name}", "sqnr_db": 10 * math.log10(ref / max(err, 1e-300)),
                         "rel_l2": math.sqrt(err / ref)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clips", default=",".join(CLIPS))
    ap.add_argument("--probes", default=",".join(PROBES))
    ap.add_argument("--configs", default="all", help="'main' (SPLIT_CONFIGS), 'all' (and the levers) or names")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--latent-frames", type=int, default=4)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--query-blocks", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ck-kernel", action="store_true",
                    help="CUDA: also run comfy-kitchen's int8_attention itself (config comfy_kitchen_kernel), "
                         "to check our model of it")
    ap.add_argument("--kernels", default="",
                    help="CUDA: comma list of real kernels run on the same probes, bf16 inputs, against float64 "
                         f"attention of the same bf16 inputs: {', '.join(KERNELS)}")
    ap.add_argument("--quick", action="store_true", help="small smoke configuration")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.heads, args.patch, args.query_blocks, args.probes = 2, 16, 2, "clean,peaked"
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    allc = {**SPLIT_CONFIGS, **LEVERS}
    names = (list(SPLIT_CONFIGS) if args.configs == "main" else list(allc) if args.configs == "all"
             else args.configs.split(","))
    stamp = {"date": datetime.date.today().isoformat(),
             "machine": (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                         f"CPU {platform.machine()} {torch.get_num_threads()} threads") + f", torch {torch.__version__}"}
    print(stamp, flush=True)
    rows = []
    t_start = time.time()
    for pname in args.probes.split(","):
        for clip in args.clips.split(","):
            probe = build_probe(clip=clip, heads=args.heads, latent_frames=args.latent_frames, patch=args.patch,
                                **PROBES[pname])
            q, k, v = probe.q.to(dev), probe.k.to(dev), probe.v.to(dev)
            plan = plan_v_smooth(v, num_clusters=64, iters=10, backend="reference" if dev.type == "cpu" else "auto")
            qidx = query_blocks(probe.n, args.query_blocks, seed=7).to(dev)
            o_ck = None
            if args.ck_kernel:  # the real kernel, fp32 inputs (it returns bf16), all heads at once
                from comfy_kitchen.sage_attention import int8_attention

                o_ck = int8_attention(q.contiguous(), k.contiguous(), v.contiguous()).float()
            rows += kernel_rows(args.kernels, q, k, v, plan, qidx, pname, clip, probe)
            for h in range(args.heads):
                qh, kh, vh = q[0, h], k[0, h], v[0, h]
                o_ref = torch.softmax(qh[qidx].double() @ kh.double().T * qh.shape[-1] ** -0.5, -1) @ vh.double()
                for name in names:
                    _, row = error_split(qh, qidx, kh, vh, plan.perm[0, h], allc[name], o_ref)
                    rows.append({"probe": pname, "clip": clip, "N": probe.n, "head": h,
                                 "gain": probe.meta["gain"][h], "config": name, **row})
                if o_ck is not None:
                    err = (o_ck[0, h, qidx].double() - o_ref).pow(2).sum().item()
                    ref = o_ref.pow(2).sum().item()
                    rows.append({"probe": pname, "clip": clip, "N": probe.n, "head": h,
                                 "gain": probe.meta["gain"][h], "config": "comfy_kitchen_kernel", "sqnr_db": 10 * math.log10(ref / err),
                                 "rel_l2": math.sqrt(err / ref)})
            print(f"[{pname} {clip}] N={probe.n} {time.time() - t_start:.0f}s: " + " ".join(
                f"{n}={_mean(rows, pname, clip, n):.1f}" for n in names[:7]), flush=True)
    for r in rows:
        r.update(stamp)
    out = pathlib.Path(args.out) / f"fidelity_error_split{'_' + args.tag if args.tag else ''}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out, rows)
    print(f"wrote {out} ({len(rows)} rows)")
    kernel_names = [f"kernel:{n}" for n in args.kernels.split(",") if n]
    print_tables(rows, names + (["comfy_kitchen_kernel"] if args.ck_kernel else []) + kernel_names,
                 args.probes.split(","),
                 args.clips.split(","))


def _mean(rows, probe, clip, config, key="sqnr_db"):
    sel = [r[key] for r in rows if r["probe"] == probe and (clip is None or r["clip"] == clip)
           and r["config"] == config and key in r]
    return sum(sel) / len(sel) if sel else math.nan


def print_tables(rows, names, probe_names, clips):
    print("\nmean SQNR dB over heads and clips: whole | Q/K term | P term | V term")
    print("| config | " + " | ".join(probe_names) + " |")
    print("|---|" + "---|" * len(probe_names))
    for n in names:
        cells = [" / ".join(f"{_mean(rows, p, None, n, key):.1f}" for key in
                            ("sqnr_db", "sqnr_qk_db", "sqnr_p_db", "sqnr_v_db")) for p in probe_names]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\nper clip, whole-error SQNR dB")
    print("| config | " + " | ".join(f"{p} {c}" for p in probe_names for c in clips) + " |")
    for n in names:
        print(f"| {n} | " + " | ".join(f"{_mean(rows, p, c, n):.2f}" for p in probe_names for c in clips) + " |")


if __name__ == "__main__":
    main()
