"""benchmarks/sm90_patch_ab.py with ptxhook.py's PTX rewrite installed (fourteenth session, runs 1-3 of
../sm90_fourteenth_session_ab_h200_2026-11-30.log). From the repository root:
    python3 benchmarks/results/sm90_fourteenth_session_patches_2026-11-30/run_ab.py [sm90_patch_ab.py arguments]
The rewrite applies only to copies whose PTX carries the marker VCHOOK (nobar*.patch add it)."""
import pathlib
import runpy
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import ptxhook  # noqa: E402,F401  (installs the stage hook)

sys.argv = ["benchmarks/sm90_patch_ab.py"] + sys.argv[1:]
runpy.run_path("benchmarks/sm90_patch_ab.py", run_name="__main__")
