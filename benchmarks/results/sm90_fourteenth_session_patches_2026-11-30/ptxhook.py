"""Development experiment (fourteenth session; superseded by NAMED_RING and ptx_pass in kernels/gluon/attention_sm90.py): PTX rewrite of the sm90 kernel's consumer mbarrier traffic, applied only to PTX
that carries the marker VCHOOK (added by the nobar patch). Triton 3.6 emits `bar.sync <id>, 128` before every
consumer mbarrier.arrive and mbarrier.try_wait (partition-level ops): two warpgroup barriers per key tile. (Triton 3.6 only: 3.8+ also call the hook with no arguments.)
- arrive: each warp arrives on its own (lane 0, after bar.warp.sync), empty barriers counted 8 (4 warps x 2
  warpgroups) instead of 2: a warp's wgmma reads are complete once its own wait returned;
- try_wait: every thread spins on the mbarrier itself, no warpgroup barrier first."""
import re
from triton import knobs

ARRIVE = re.compile(r"\tbar\.sync \t(\d+), 128;\n(\t// begin inline asm\n)\t@%p\d+ mbarrier\.arrive\.shared::cta\.b64 _, \[(%r\d+)\];")
WAIT = re.compile(r"\tbar\.sync \t\d+, 128;\n(\t// begin inline asm\n\s*\n\{\n\t\.reg \.pred complete;\n\twaitLoop:\n\tmbarrier\.try_wait)")
INIT2 = re.compile(r"(mbarrier\.init\.shared::cta\.b64 \[%r\d+\]), 2;")
STATS = {}


def rewrite(ptx):
    if "VCHOOK" not in ptx:
        return ptx
    ptx, na = ARRIVE.subn(lambda m: ("\tbar.warp.sync -1;\n" + m.group(2) +
                                     "\t{ .reg .pred vcp; .reg .b32 vcl; mov.u32 vcl, %laneid; setp.eq.u32 vcp, vcl, 0;\n"
                                     f"\t@vcp mbarrier.arrive.shared::cta.b64 _, [{m.group(3)}]; }}"), ptx)
    ptx, nw = WAIT.subn(r"\1", ptx)
    ptx, ni = INIT2.subn(r"\1, 8;", ptx)
    STATS.update(arrive=na, wait=nw, init=ni)
    print(f"[ptxhook] arrives {na}, waits {nw}, inits {ni}", flush=True)
    assert na + nw + ni > 0
    return ptx


def hook(self, stages, options, language, capability):
    make_ptx = stages["ptx"]
    stages["ptx"] = lambda src, metadata: rewrite(make_ptx(src, metadata))


knobs.runtime.add_stages_inspection_hook = hook
