"""The mma.sync attention kernel built for sm_89 and run on a newer GPU from its PTX.

PTX is forward compatible: the sm_89 build's PTX, loaded through the CUDA driver, is JIT-compiled
for the GPU at hand (an H100 / H200 runs it on its mma.sync path), so the workstation build's
algorithm, tiles and instruction kinds can be checked and timed on a card that is not a workstation
card (tests/gpu/test_mma_gpu.py, benchmarks/workstation_proxy.py). The driver calls are the loader's.
"""

import ctypes

import torch

from ..triton import attention_mma as am
from .build import ptx_params
from .loader import (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                     CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                     get_driver)

TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class PTXModule:
    """One compiled Triton kernel, its PTX loaded through the CUDA driver (JIT for this GPU)."""

    def __init__(self, compiled, runtime_names):
        self.compiled = compiled
        md = compiled.metadata
        self.name = md.name
        self.num_warps = md.num_warps
        self.shared = md.shared
        ptx = compiled.asm["ptx"]
        self.ptx_target = next((l.split()[1] for l in ptx.splitlines() if l.startswith(".target")), "?")
        self.mma_kinds = sorted({l.strip().split(" ")[0] for l in ptx.splitlines() if l.strip().startswith("mma.")})
        self.n_params = len(ptx_params(ptx, md.name))
        self.runtime_names = runtime_names
        self.driver = get_driver()
        self.driver.ensure_context(torch.cuda.current_device())
        self.module, self.fn = self.driver.load(ptx.encode() + b"\0", md.name)
        if self.shared > 49152:
            optin = self.driver.device_attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, torch.cuda.current_device())
            self.driver.prefer_shared(self.fn)
            static = self.driver.func_attr(self.fn, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            self.driver.set_func_attr(self.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static)
        self.scratch = getattr(md, "global_scratch_size", 0) or 0

    def __call__(self, grid, args):
        values = []
        for name in self.runtime_names:
            v = args[name]
            if hasattr(v, "data_ptr"):
                values.append(ctypes.c_uint64(v.data_ptr()))
            elif isinstance(v, float):
                values.append(ctypes.c_float(v))
            else:
                values.append(ctypes.c_int32(int(v)))
        keep = []
        for i in range(self.n_params - len(values)):
            if i == 0 and self.scratch:
                buf = torch.empty(grid[0] * grid[1] * self.scratch + 256, dtype=torch.uint8, device="cuda")
                keep.append(buf)
                values.append(ctypes.c_uint64((buf.data_ptr() + 255) // 256 * 256))
            else:
                values.append(ctypes.c_uint64(0))
        grid = tuple(grid) + (1,) * (3 - len(grid))
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self.driver.launch(self.fn, grid, 32 * self.num_warps, self.shared,
                           torch.cuda.current_stream().cuda_stream, ctypes.addressof(params))
        del keep


class SM89Launcher:
    """A pipeline.py launcher: the attention kernel from its sm_89 PTX (compiled per variant on first
    use), everything else (the pre-pass) through Triton's JIT as usual."""

    def __init__(self):
        self.cache = {}
        # The kernel's run-time parameters: its arguments less the constexprs that have a default
        # (a launch may leave those out; they are compiled in).
        defaults = am.kernel_defaults(am.vc_attention_mma_fwd_kernel)
        self.names = [n for n in am.vc_attention_mma_fwd_kernel.arg_names if n not in defaults]

    def build(self, constexprs, out_dtype, num_warps, num_stages, lse=False):
        """(the sm_89 compile of this variant, its run-time parameter names in PTX order): no GPU needed."""
        c = constexprs
        ck = am.compile_mma_attention(
            89, head_dim=c["HEAD_DIM"], v_smooth=c["HAS_MEAN"], has_bias=c["HAS_BIAS"], expcast=c["EXPCAST"],
            out_dtype=out_dtype, block_m=c["BLOCK_M"], block_n=c["BLOCK_N"], run_tiles=c["RUN_TILES"],
            num_warps=num_warps, num_stages=num_stages, pv_acc16=c["PV_ACC16"], rowsum_cuda=c["ROWSUM_CUDA"],
            exp2_fma=c.get("EXP2_FMA"), expcast_tail=c.get("EXPCAST_TAIL"), lse=lse, pv_int8=c.get("PV_INT8", False),
            q_token=c.get("Q_TOKEN", False))
        skip = (set(c) | {"stride_od"} | ({"MU"} if not c["HAS_MEAN"] else set())
                | ({"BIAS"} if not c["HAS_BIAS"] else set()) | ({"LSE"} if not lse else set())
                | ({"VCS", "VRATIO"} if not c.get("PV_INT8") else set()))
        return ck, [n for n in self.names if n not in skip]

    def __call__(self, kernel, grid, args, constexprs, num_warps, num_stages=None):
        if kernel != "vc_attention_mma_fwd_kernel":
            return am.mma_launch(kernel, grid, args, constexprs, num_warps, num_stages)
        if args["stride_od"] != 1:
            raise ValueError("the sm_89 build assumes a unit last stride of the output")
        lse = args.get("LSE") is not None
        key = (tuple(sorted(constexprs.items())), TRITON_TYPE[args["O"].dtype], num_warps, num_stages, lse)
        mod = self.cache.get(key)
        if mod is None:
            mod = self.cache[key] = PTXModule(*self.build(constexprs, TRITON_TYPE[args["O"].dtype], num_warps,
                                                          num_stages, lse))
        mod(grid, args)
