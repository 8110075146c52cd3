"""A rewrite of the kernel's PTX for what Gluon cannot say: no warpgroup barrier before a consumer's
mbarrier wait.

Triton puts a warpgroup barrier (bar.sync <id>, 128) before every mbarrier wait of a consumer
partition: its shared-memory analysis orders each wait after the one before it on the same barrier
array. The wait needs none (every thread polls the mbarrier itself, and nothing in the consumer
writes shared memory). In the builds whose ring stages go back on named barriers (Schedule.named_ring;
their PTX carries RING_MARK, written by ring.py's stage release) ptx_pass deletes it: then no
warpgroup barrier is left in the key-tile loop. Any other PTX is returned unchanged, and PTX that no
longer matches the pattern is left alone (slower, the same output);
tests/kernels/test_gluon_sm90.py checks the hot loop's SASS on the Tritons in use.

Installed by ptx_pass_installed() around each compile (launch_sm90.py), through Triton's stage hook.
"""

import contextlib
import hashlib
import re

# a 128-thread bar.sync, then only comments, .loc lines, "{", a predicate declaration and a label (the
# try_wait loop's inline asm as Triton 3.6-3.9 write it), then the mbarrier.try_wait
_BAR_BEFORE_WAIT = re.compile(r"\tbar\.sync \t\d+, 128;\n((?:[ \t]*(?://[^\n]*|\.loc[^\n]*|\{|\.reg \.pred \w+;|\w+:)?"
                              r"[ \t]*\n)*?[ \t]*mbarrier\.try_wait)")
# The pass's identity in every cache key of a kernel it rewrote: Triton 3.8+ take _PASS_KEY from the
# stage hook; 3.6 hashes the constexpr globals a kernel reads, among them ring.py's copy of RING_MARK.
_PASS_KEY = "vc-attention-ptx-pass-" + hashlib.sha256(_BAR_BEFORE_WAIT.pattern.encode()).hexdigest()[:16]
RING_MARK = "// vc-attention named ring, " + _PASS_KEY


def ptx_pass(ptx):
    """The kernel's PTX without the warpgroup barriers before its consumers' mbarrier waits (named-ring
    builds only; any other PTX unchanged)."""
    if RING_MARK not in ptx:
        return ptx
    return _BAR_BEFORE_WAIT.sub(r"\1", ptx)


@contextlib.contextmanager
def ptx_pass_installed():
    """Triton's stage hook (knobs.runtime.add_stages_inspection_hook) set to ptx_pass, chained after
    any hook already there, for the compiles inside the block. Triton 3.8+ also call the hook with no
    arguments for a cache key, so kernels built with and without the pass are cached apart; 3.6 does
    not (a kernel of this source compiled without the pass, outside launch_sm90's launch and
    compile_sm90, would be reused from the cache without it: slower, the same output). A Triton
    without the hook compiles without the pass."""
    from triton import knobs

    if not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        yield
        return
    prev = knobs.runtime.add_stages_inspection_hook

    def hook(*args):
        if not args:  # Triton 3.8+: the cache key of this pipeline
            key, digest = prev() if prev is not None else ("", "")
            return key + _PASS_KEY, digest + _PASS_KEY
        if prev is not None:
            prev(*args)
        stages = args[1]
        make_ptx = stages["ptx"]
        stages["ptx"] = lambda src, metadata: ptx_pass(make_ptx(src, metadata))

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = prev
