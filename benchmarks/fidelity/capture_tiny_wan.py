"""Capture the self-attention inputs of a tiny random Wan 2.1 model sampled by real ComfyUI, for
schedule_effect.py (FIDELITY.md "Schedule effect").

    python benchmarks/fidelity/capture_tiny_wan.py --out capture/

Run it with ComfyUI's Python; ComfyUI is found as the node tests find it (``COMFYUI_PATH``, or the
ComfyUI whose ``custom_nodes/`` holds this pack). The capture itself is ``tests/attention_capture.py``
(shared with tests/nodes/test_capture_schedule.py); it writes ``<out>/capture.pt`` (a few hundred MB
at the defaults: not for git).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from attention_speed import register_package  # noqa: E402  (this checkout as vc_attention)

register_package()
sys.path.insert(0, str(ROOT / "tests"))  # the ComfyUI harness of the node tests
from attention_capture import capture  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("capture"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--frames", type=int, default=4, help="latent frames")
    ap.add_argument("--height", type=int, default=32, help="latent height (tokens: /2)")
    ap.add_argument("--width", type=int, default=32, help="latent width (tokens: /2)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cfg", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-seed", type=int, default=1)
    a = ap.parse_args(argv)
    data = capture(a.out, layers=a.layers, frames=a.frames, height=a.height, width=a.width, steps=a.steps,
                   cfg=a.cfg, seed=a.seed, model_seed=a.model_seed)
    c = data["calls"]
    print(f"captured {len(c)} self-attention calls, steps {sorted({x['step'] for x in c})}, "
          f"q {tuple(c[0]['q'].shape)}; window sigma {data['window_sigma']:.4f}; "
          f"sampling {data['config']['sample_wall_s']:.1f}s -> {a.out / 'capture.pt'}")


if __name__ == "__main__":
    main()
