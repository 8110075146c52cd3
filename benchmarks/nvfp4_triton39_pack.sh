#!/usr/bin/env bash
# Packs Triton 3.9 (cp312, manylinux x86_64) for a Hopper GPU machine without network access, to run
# the native NVFP4 kernel (tl.dot_scaled, e2m1 + E4M3 group-16 scales) emulated on sm_90 against the
# reference (tests/gpu/test_nvfp4_gpu.py). With network access, `pip install triton==3.9.0` in a
# separate venv does the same.
#
# Why: torch 2.11 pins Triton 3.6, and Triton 3.6 cannot decompose an E4M3-scaled dot_scaled on
# sm_90 (its DecomposeScaledBlocked handles only E8M0 uint8 scales); Triton 3.8 and 3.9 can.
# tests/gpu/test_nvfp4_gpu.py xfails under 3.6 and runs for real under 3.9.
#
# What is kept: the Python package, libtriton.so with its debug info stripped (500 MB -> 190 MB),
# ptxas-blackwell (the ptxas Triton 3.9 uses for sm_90 and newer), the CUDA headers and libdevice;
# the AMD backend keeps only its Python files (torch's Triton 3.6 registers it as an entry point),
# and CUPTI, proton, the legacy ptxas (< sm_90), nvdisasm, cuobjdump, FileCheck, plugins and
# instrumentation are left out. xz -9 of the rest (the size is printed last; above 60 MiB the
# archive is split into .tr39/ and .tr39_b/).
#
# Usage (repository root, a machine with network):  bash benchmarks/nvfp4_triton39_pack.sh
#   -> .tr39/triton39.tar.xz (git-ignored through .git/info/exclude); copy it to the GPU machine, then
#     mkdir -p /tmp/tr39 && tar -xJf .tr39/triton39.tar.xz -C /tmp/tr39 &&
#     PYTHONPATH=/tmp/tr39 python3 -m pytest -q -m gpu -rsx tests/gpu/test_nvfp4_gpu.py
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
out=.tr39
for d in "$out" "${out}_b"; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work/w" triton==3.9.0
unzip -q "$work"/w/triton-3.9.0-*.whl -d "$work/site"
t="$work/site/triton"
keep_amd="$work/amd"
mkdir -p "$keep_amd" && cp "$t"/backends/amd/{__init__,compiler,driver}.py "$keep_amd"/
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
  "$t/backends/nvidia/bin/ptxas" "$t/backends/nvidia/bin/nvdisasm" "$t/backends/nvidia/bin/cuobjdump" \
  "$t/instrumentation" "$t/plugins" "$t/FileCheck" "$t/_C/libproton.so"
mv "$keep_amd" "$t/backends/amd"
strip --strip-unneeded "$t/_C/libtriton.so"
rm -rf "$out" "${out}_b" && mkdir -p "$out"
tar -C "$work/site" -cf - triton | xz -9 -T0 > "$work/triton39.tar.xz"
size=$(stat -c %s "$work/triton39.tar.xz")
if [ "$size" -le $((60 * 1024 * 1024)) ]; then
  mv "$work/triton39.tar.xz" "$out/"
else
  # Two runs: the first copies part a to /tmp, the second (at once) joins part b and extracts.
  mkdir -p "${out}_b"
  split -b 60M -d -a 1 "$work/triton39.tar.xz" "$work/triton39.tar.xz."
  mv "$work/triton39.tar.xz.0" "$out/" && mv "$work/triton39.tar.xz.1" "${out}_b/"
  echo "split in two: run 1 carries $out: cp $out/triton39.tar.xz.0 /tmp/"
  echo "run 2 carries ${out}_b: cat /tmp/triton39.tar.xz.0 ${out}_b/triton39.tar.xz.1 | xz -d | tar -x -C /tmp/tr39"
fi
du -sb "$out" "${out}_b" 2>/dev/null || true
