"""The Triton launcher for the host code in kernels/pipeline.py: kernel name -> @triton.jit kernel."""

import functools


@functools.lru_cache(maxsize=None)
def _kernels():
    from . import attention, kmeans, prepass

    return {
        "vc_attention_fwd_kernel": attention.vc_attention_fwd_kernel,
        "quantize_qk_block_kernel": prepass.quantize_qk_block_kernel,
        "v_block_stats_kernel": prepass.v_block_stats_kernel,
        "v_scale_kernel": prepass.v_scale_kernel,
        "v_quantize_kernel": prepass.v_quantize_kernel,
        "kmeans_assign_kernel": kmeans.kmeans_assign_kernel,
        "kmeans_update_kernel": kmeans.kmeans_update_kernel,
    }


def kernel_by_name(name):
    return _kernels()[name]


def triton_launch(kernel, grid, args, constexprs, num_warps, num_stages=None):
    """Run a @triton.jit kernel (JIT-compiled, or interpreted under TRITON_INTERPRET=1)."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    kernel_by_name(kernel)[grid](**args, **constexprs, **options)
