"""The real SageAttention 1.0.6 package (pure Triton) on the fidelity probes (FIDELITY.md).

CPU, under Triton's interpreter:

    python benchmarks/fidelity/sage106_probes.py --heads 2
    ... --check-only              # the tiny sanity check alone (package vs exact attention)
    ... --check-only --save-probes probes/sage106_probes.pt   # write the bf16 probe tensors (15 MiB)

GPU (on a machine without the preview clips, carry the file written by --save-probes):

    python benchmarks/fidelity/sage106_probes.py --device cuda --probes-file probes/sage106_probes.pt

The package: ``sageattention`` 1.0.6, installed (``pip install sageattention==1.0.6``) or a folder
holding ``sageattention/`` given by ``--sage-path`` (then only that package is loaded, by path). It
is called exactly as
``sageattn(q, k, v, tensor_layout="HND", is_causal=False)`` (defaults: sm_scale = D^-0.5, smooth_k).

Shims (CPU only, outside the package; nothing in the package is edited):
1. ``TRITON_INTERPRET=1`` is set before triton is imported (the kernels then run in numpy).
2. ``sageattn`` begins with ``assert q.is_cuda``; on CPU, q is passed as a ``torch.Tensor`` subclass
   (``_CudaLooking``) whose ``is_cuda`` property returns True. Nothing else about the tensor changes
   (same storage, device cpu, dtype); k and v are passed as plain tensors.
3. ``sageattn`` smooths K *in place* (``k -= km``): a copy of k is passed (also on the GPU).
No other CUDA-only call is made by the 1.0.6 path used here (head_dim 128, non-causal, HND).

Inputs: the same probes as measure.py (vc_attention.kernels.fidelity.probes; default 6 latent frames, 8 px patches: N = 11,094 /
8,214 / 11,094), the same query blocks (``measure.query_blocks(N, 4, seed=7)``: 4 blocks of 128
contiguous queries, aligned to 128, so SageAttention's per-128-query INT8 blocks are those of the full
sequence) against all N keys (K's mean and K's 64-token INT8 blocks are those of the full sequence), and
measure.output_metrics (SQNR = 10 log10(||O||^2 / ||O - O_q||^2), rel L2, 1 - cosine, over the
query subset of a head) against float64 exact attention. Mean over heads and clips.

I/O dtype (``--io-dtype``): fp32 (default; sageattn then converts V to fp16 and returns fp32, as the
torch ``sage1`` row of measure.py keeps O in fp32) or bf16 (ComfyUI's dtype; O comes back in bf16, its
rounding alone is ~2^-9 relative per element).

Interpreter numerics vs the GPU: the int8 QK^T dot is exact in both (int32), exp2 is numpy's (the GPU's
ex2.approx differs by ~2 ulp), P -> fp16 rounds to nearest in both. The P.V dot is
``tl.dot(p, v, out_dtype=tl.float16)``: the interpreter does it with ``np.matmul(..., dtype=float16)``,
which (checked at run time: ``numpy_fp16_matmul_is_single_rounding``) returns the exact
product sum rounded to fp16 *once* per 64-key tile; on the GPU the fp16-accumulating MMA rounds the
running sum to fp16 at least once per k-step (16 keys for fp16 mma / wgmma; the internal precision
within a Hopper wgmma f16 accumulation is not documented). So the interpreter is *optimistic* about
the P.V accumulation. The emulations (on unless ``--no-emulate``) quantify it with torch emulations of the package's
algorithm (INT8 blocks, online softmax, l_i from fp32 P) under three P.V accumulation models:
    emu_fp32_tile      exact within the 64-key tile, one fp16 rounding (= the interpreter; checked)
    emu_fp16_per_16    exact within 16 keys, fp16 rounding of the running tile sum every 16 keys
                       (a model of the GPU's f16-accumulating MMA, k = 16)
    emu_fp16_per_key   fp16 rounding after every key (a pessimistic bound)
The emulations also reproduce one behaviour of the package found here: for kv_len not a multiple of 64
(11,094 and 8,214 are not) the last tile's masked K loads read 0 and its scores are not masked, so the
42 padded keys enter the row max and the row sum with score 0 while their V reads 0 (a small dilution
of every output row; on the probes it cost 0.49-0.64 dB on head 4 of each clip and < 0.1 dB on the
other 21 heads; on the GPU a masked load without ``other`` is zero-filled in practice, so the same is
expected there).
The GPU run (``--device cuda``) measures the package itself on the saved tensors and prints the
emulations next to it, so the GPU's accumulation can be read off directly.

Writes ``benchmarks/results/fidelity_sage106{tag}.csv`` (per clip and head).
"""

from __future__ import annotations

import os
import sys

_ON_CUDA = "--device=cuda" in sys.argv or any(
    a == "--device" and sys.argv[i + 1:i + 2] == ["cuda"] for i, a in enumerate(sys.argv))
if not _ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (shim 1)

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"

from vc_attention.kernels.fidelity.simulate import output_metrics, query_blocks, simulate, write_csv  # noqa: E402

CLIPS = ("wan22_14b", "hunyuan15", "wan22_5b")


# ------------------------------------------------------------------------------------ the package


def load_sageattention(sage_path: str | None):
    """The installed ``sageattention``, or (``--sage-path DIR``) only ``DIR/sageattention/``, by path."""
    if not sage_path:
        import sageattention

        return sageattention
    base = pathlib.Path(sage_path)
    if not (base / "sageattention" / "__init__.py").exists():
        raise FileNotFoundError(f"no sageattention/ package in {base}")
    spec = importlib.util.spec_from_file_location(
        "sageattention", base / "sageattention" / "__init__.py",
        submodule_search_locations=[str(base / "sageattention")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sageattention"] = mod
    spec.loader.exec_module(mod)
    return mod


class _CudaLooking(torch.Tensor):
    """Shim 2: a CPU tensor that answers ``is_cuda`` with True (sageattn's first assert)."""

    @property
    def is_cuda(self):  # noqa: D401
        return True


def run_sage106(sage, q, k, v, device: str, io_dtype: torch.dtype):
    """q [M, D], k, v [N, D] (one head) -> O [M, D] fp64 from ``sageattn(..., "HND", False)``."""
    qq = q.to(device=device, dtype=io_dtype)[None, None].contiguous()
    kk = k.to(device=device, dtype=io_dtype)[None, None].contiguous().clone()  # shim 3: k -= km in place
    vv = v.to(device=device, dtype=io_dtype)[None, None].contiguous()
    if device == "cpu":
        qq = qq.as_subclass(_CudaLooking)
    o = sage.sageattn(qq, kk, vv, tensor_layout="HND", is_causal=False)
    if device == "cuda":
        torch.cuda.synchronize()
    return torch.Tensor.double(o.as_subclass(torch.Tensor))[0, 0].cpu()


# --------------------------------------------------------------- torch emulations of the package


def _int8_blocks(x, blk, scale_mul):
    """SageAttention 1.0.6's quant_per_block_int8_kernel: per block of ``blk`` tokens,
    scale = max|x * s| / 127, code = trunc(x / scale + 0.5 sign) (half away from zero)."""
    x = x.float() * scale_mul
    n = x.shape[0]
    nb = -(-n // blk)
    xp = torch.nn.functional.pad(x, (0, 0, 0, nb * blk - n)).view(nb, blk, -1)
    scale = xp.abs().amax((1, 2)) / 127.0
    y = xp / scale[:, None, None]
    y = y + 0.5 * torch.where(y >= 0, 1.0, -1.0)
    codes = y.to(torch.int32).clamp(-128, 127)  # .to(int8) truncates toward zero
    return codes.view(nb * blk, -1)[:n], scale


def emulate_sage106(q, k, v, pv: str, io_dtype=torch.float32):
    """The 1.0.6 forward (head_dim 128, non-causal) in torch. pv: 'fp16_per_key' | 'fp16_per_16' |
    'fp32_tile' (see the module docstring) | 'exact' (diagnostic: the tile's P.V kept in fp32)."""
    D = q.shape[-1]
    q = q.to(io_dtype).float()
    k = k.to(io_dtype)
    k = (k - k.mean(0, keepdim=True)).to(io_dtype).float()  # k -= km in the I/O dtype
    v16 = v.to(io_dtype).to(torch.float16).float()
    qc, qs = _int8_blocks(q, 128, D ** -0.5 * 1.44269504)
    kc, ks = _int8_blocks(k, 64, 1.0)
    M, N = q.shape[0], k.shape[0]
    out = torch.empty(M, D, dtype=torch.float64)
    for b0 in range(0, M, 128):
        qb = qc[b0 : b0 + 128].double()
        q_scale = qs[b0 // 128]
        m_i = torch.full((qb.shape[0],), -math.inf)
        l_i = torch.ones(qb.shape[0])
        acc = torch.zeros(qb.shape[0], D)
        for t, n0 in enumerate(range(0, N, 64)):
            kt = kc[n0 : n0 + 64].double()
            s = (qb @ kt.T).float() * q_scale * ks[t]
            pad = 64 - kt.shape[0]
            if pad:  # the package's last tile: masked K loads read 0, and the scores are not masked, so
                # the padded keys enter the max and the row sum with score 0 (their V reads 0)
                s = torch.cat([s, torch.zeros(s.shape[0], pad)], 1)
            m_ij = torch.maximum(m_i, s.amax(1))
            p = torch.exp2(s - m_ij[:, None])
            alpha = torch.exp2(m_i - m_ij)
            l_i = l_i * alpha + p.sum(1)
            acc = acc * alpha[:, None]
            p16 = p.half().float()
            vt = v16[n0 : n0 + 64]
            if pad:
                vt = torch.cat([vt, torch.zeros(pad, D)], 0)
            if pv == "fp32_tile":
                pvt = (p16.double() @ vt.double()).half().float()
            elif pv == "exact":  # diagnostic: no fp16 rounding of the tile's P.V (fp32 accumulation)
                pvt = (p16.double() @ vt.double()).float()
            else:
                step = 1 if pv == "fp16_per_key" else 16
                run = torch.zeros(qb.shape[0], D)
                for j in range(0, vt.shape[0], step):
                    part = p16[:, j : j + step].double() @ vt[j : j + step].double()
                    run = (run.double() + part).float().half().float()
                pvt = run
            acc = acc + pvt
            m_i = m_ij
        out[b0 : b0 + 128] = (acc / l_i[:, None]).to(io_dtype).double()
    return out


# ----------------------------------------------------------------------------------------- probes


def probe_heads(args):
    """Yield dicts clip, head, N, q (query subset) [M, D], k, v [N, D] (fp32 or bf16 -> fp32)."""
    if args.probes_file:
        blob = torch.load(args.probes_file, map_location="cpu")
        for item in blob["heads"]:
            yield {**item, "q": item["q"].float(), "k": item["k"].float(), "v": item["v"].float(),
                   "source": f"file bf16 ({pathlib.Path(args.probes_file).name})"}
        return
    from vc_attention.kernels.fidelity.probes import ProbeConfig, build_probe

    for clip in args.clips.split(","):
        probe = build_probe(ProbeConfig(clip=clip, heads=args.heads, latent_frames=args.latent_frames,
                                        patch=args.patch))
        N = probe.n
        qidx = query_blocks(N, args.query_blocks, seed=7)
        for h in range(args.first_head, args.heads):
            yield {"clip": clip, "head": h, "N": N, "q": probe.q[0, h, qidx], "k": probe.k[0, h],
                   "v": probe.v[0, h], "source": "probes fp32"}


def save_probes(args, path):
    """bf16 probe tensors of ``--save-heads`` heads per clip: query subset of Q, all of K and V."""
    from vc_attention.kernels.fidelity.probes import ProbeConfig, build_probe

    heads = []
    for clip in args.clips.split(","):
        probe = build_probe(ProbeConfig(clip=clip, heads=max(args.save_heads, 1),
                                        latent_frames=args.latent_frames, patch=args.patch))
        qidx = query_blocks(probe.n, args.query_blocks, seed=7)
        for h in range(args.save_heads):
            heads.append({"clip": clip, "head": h, "N": probe.n,
                          "q": probe.q[0, h, qidx].bfloat16().contiguous(),
                          "k": probe.k[0, h].bfloat16().contiguous(),
                          "v": probe.v[0, h].bfloat16().contiguous()})
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"heads": heads, "latent_frames": args.latent_frames, "patch": args.patch,
                "query_blocks": args.query_blocks, "query_seed": 7}, path)
    print(f"saved {len(heads)} heads to {path} ({path.stat().st_size / 2**20:.1f} MiB)")


# ------------------------------------------------------------------------------------------- main


def numpy_fp16_matmul_is_single_rounding() -> bool:
    """What the interpreter's fp16-output dot does: np.matmul(a, b, dtype=float16) vs the exact sum
    rounded once to fp16."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.random((64, 64)).astype(np.float16)
    b = rng.standard_normal((64, 64)).astype(np.float16)
    r = np.matmul(a, b, dtype=np.float16)
    once = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float16)
    return bool((r == once).mean() > 0.99)


def tiny_check(sage, device):
    """Random tiny case (1 head, 256 queries, 384 keys, D = 128): package vs exact attention, and vs
    the fp32-tile emulation (the interpreter's P.V numerics)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 128, generator=g) for n in (256, 384, 384))
    ref = torch.softmax(q.double() @ k.double().T / math.sqrt(128), -1) @ v.double()
    o = run_sage106(sage, q, k, v, device, torch.float32)
    m = output_metrics(ref, o)
    emu = emulate_sage106(q, k, v, "fp32_tile")
    d = ((o - emu).norm() / o.norm()).item()
    print(f"tiny check: rel L2 vs exact {m['rel_l2']:.2e} (SQNR {m['sqnr_db']:.1f} dB); "
          f"vs the fp32-tile emulation {d:.1e}; max |o| {o.abs().max():.2f}; numpy fp16 matmul "
          f"rounds once: {numpy_fp16_matmul_is_single_rounding()}", flush=True)
    return m["rel_l2"], d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--sage-path", default=None, help="directory holding sageattention/ (default: the installed package)")
    ap.add_argument("--clips", default=",".join(CLIPS))
    ap.add_argument("--heads", type=int, default=2, help="heads per clip (measure.py: 8)")
    ap.add_argument("--first-head", type=int, default=0, help="measure heads first-head .. heads-1")
    ap.add_argument("--latent-frames", type=int, default=6)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--query-blocks", type=int, default=4)
    ap.add_argument("--io-dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--probes-file", default=None, help="bf16 tensors written by --save-probes")
    ap.add_argument("--save-probes", default=None, help="write bf16 probe tensors (query subset, K, V) here")
    ap.add_argument("--save-heads", type=int, default=1, help="heads per clip in --save-probes (1: ~16 MB)")
    ap.add_argument("--no-emulate", action="store_true", help="skip the torch emulations")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.save_probes:
        save_probes(args, args.save_probes)
    sage = load_sageattention(args.sage_path)
    io_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.io_dtype]
    dev = (torch.cuda.get_device_name() if args.device == "cuda" else
           f"CPU {platform.machine()} {torch.get_num_threads()} threads, Triton interpreter")
    import triton

    stamp = {"date": datetime.date.today().isoformat(), "machine": dev, "torch": torch.__version__,
             "triton": triton.__version__, "io_dtype": args.io_dtype}
    print(stamp, flush=True)
    tiny_rel, tiny_emu = tiny_check(sage, args.device)
    if args.check_only:
        return
    rows = []
    t_all = time.time()
    for item in probe_heads(args):
        q, k, v = item["q"], item["k"], item["v"]
        t0 = time.time()
        o_ref = torch.softmax(q.double() @ k.double().T * q.shape[-1] ** -0.5, -1) @ v.double()
        base = {"clip": item["clip"], "head": item["head"], "N": item["N"], "inputs": item["source"],
                "tiny_check_rel_l2": tiny_rel, **stamp}
        o = run_sage106(sage, q, k, v, args.device, io_dtype)
        t_pkg = time.time() - t0
        r = {**base, "method": f"sage106_package_{'gpu' if args.device == 'cuda' else 'interpreter'}",
             **output_metrics(o_ref, o), "seconds": t_pkg}
        rows.append(r)
        line = f"[{item['clip']} h{item['head']} N={item['N']}] package {r['sqnr_db']:.2f} dB ({t_pkg:.0f}s)"
        perm = torch.arange(k.shape[0])
        pq, vq, _ = simulate(q, k, v, perm, method="sage1", qk="int8")  # measure.py's torch sage1-like row
        rows.append({**base, "method": "sage1_torch_like", **output_metrics(o_ref, pq.double() @ vq.double())})
        line += f" | sage1-like {rows[-1]['sqnr_db']:.2f}"
        if not args.no_emulate:
            for pv in ("fp16_per_key", "fp16_per_16", "fp32_tile"):
                e = emulate_sage106(q, k, v, pv, io_dtype)
                rows.append({**base, "method": f"emu_{pv}", **output_metrics(o_ref, e),
                             "rel_diff_to_package": ((e - o).norm() / o.norm()).item()})
                line += f" | emu_{pv} {rows[-1]['sqnr_db']:.2f} (vs pkg {rows[-1]['rel_diff_to_package']:.1e})"
        print(line + f" [{time.time() - t0:.0f}s]", flush=True)
    for r in rows:
        r["one_minus_cos"] = 1.0 - r["cosine"]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    path = out / f"fidelity_sage106{tag}.csv"
    write_csv(path, rows)
    print(f"\n== mean over heads ({len({(r['clip'], r['head']) for r in rows})} heads), total "
          f"{time.time() - t_all:.0f}s; wrote {path} ==")
    methods = list(dict.fromkeys(r["method"] for r in rows))
    clips = list(dict.fromkeys(r["clip"] for r in rows))
    for m in methods:
        sel = [r for r in rows if r["method"] == m]
        per_clip = " ".join(f"{c} {sum(r['sqnr_db'] for r in sel if r['clip'] == c) / max(1, sum(r['clip'] == c for r in sel)):.2f}"
                            for c in clips)
        print(f"  {m:32s} SQNR {sum(r['sqnr_db'] for r in sel) / len(sel):6.2f} dB  rel L2 "
              f"{sum(r['rel_l2'] for r in sel) / len(sel):.3e}  1-cos "
              f"{sum(r['one_minus_cos'] for r in sel) / len(sel):.1e}  ({per_clip})")


if __name__ == "__main__":
    main()
