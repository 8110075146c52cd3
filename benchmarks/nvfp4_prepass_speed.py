"""The 4-bit pre-pass (kernels/triton/attention_fp4.py::prepare_fp4: NVFP4 Q, K and V's residual)
with and without the group-scale search, with V-Smooth's means per 8 tokens or per 128-row block,
at two real shapes, on a CUDA GPU.

    python benchmarks/nvfp4_prepass_speed.py        # writes nvfp4_prepass_speed.json into $OUT or .

Per shape and setting (scale_search "" = the usual amax rule, "v" = V's scales searched, "qkv" =
the default; mean_group 8 = the default, 128 = the block mean): 2 warm-up calls, then 10 timed with
CUDA events; the median and the minimum. Each setting runs twice, interleaved. bf16 inputs, a random
permutation (a V-Smooth plan's shape). Checked: every scale a finite E4M3 byte, the search changes
some of V's, the means' fp16 operand is finite (the codes against the reference:
tests/gpu/test_nvfp4_gpu.py).
"""

import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from attention_speed import register_package  # noqa: E402  (imports this checkout as vc_attention)

register_package()
from vc_attention.kernels.triton.attention_fp4 import prepare_fp4  # noqa: E402

SHAPES = (("wan14b-720p", 40, 75600), ("wan5b-720p", 24, 27280))
SETTINGS = (("", 128), ("qkv", 128), ("", 8), ("v", 8), ("qkv", 8))


def main():
    rows = []
    for name, H, N in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, H, N, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        perm = torch.stack([torch.randperm(N, device="cuda") for _ in range(H)]).view(1, H, N)
        for search, group in SETTINGS + SETTINGS:
            for _ in range(2):
                prepare_fp4(q, k, v, perm=perm, scale_search=search, mean_group=group)
            torch.cuda.synchronize()
            ts = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                prepare_fp4(q, k, v, perm=perm, scale_search=search, mean_group=group)
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b))
            ts.sort()
            prep = prepare_fp4(q, k, v, perm=perm, scale_search=search, mean_group=group)
            scales = [prep[t]["scales"] for t in "qkv"]
            if group < 128:
                assert torch.isfinite(prep["v"]["mu16"]).all() and torch.isfinite(prep["v"]["mu_factor"]).all()
            # every scale a finite E4M3 byte (0x7F / 0xFF are NaN); the search moves some of them
            assert all(((s & 0x7F) != 0x7F).all().item() for s in scales), (name, search)
            if search:
                base = prepare_fp4(q, k, v, perm=perm, scale_search="", mean_group=group)
                assert not torch.equal(base["v"]["scales"], prep["v"]["scales"]), (name, search)
            rows.append({"shape": name, "H": H, "N": N, "scale_search": search, "mean_group": group,
                         "median_ms": ts[len(ts) // 2],
                         "min_ms": ts[0]})
            print(rows[-1], flush=True)
    out = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "command": "python benchmarks/nvfp4_prepass_speed.py",
           "rows": rows}
    path = pathlib.Path(os.environ.get("OUT", ".")) / "nvfp4_prepass_speed.json"
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
