"""The public API: argument checks, backend choice and fallbacks, the custom op under torch.compile."""

import logging
import math

import pytest
import torch

from vc_attention.kernels import explain_backend, plan_v_smooth, vc_attention
from vc_attention.kernels import dispatch
from vc_attention.kernels.reference import exact_attention

from kernel_helpers import rel_l2, video_like_qkv


def qkv(N=64, D=64, dtype=torch.bfloat16, layout="HND"):
    return video_like_qkv(1, 2, N, D, dtype=dtype, layout=layout)


# --- backend choice (the registry's choices per GPU: test_registry.py) ---------------------------

def test_auto_on_cpu_falls_back_to_sdpa_and_says_why(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv()
    decision = explain_backend(q, k, v)
    assert decision.backend == "sdpa" and not decision.low_bit and decision.fallback
    assert "not a CUDA GPU" in decision.reasons["triton"]
    assert "sdpa" in str(decision) and "triton refused" in str(decision)
    dispatch._logged.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vc_attention"):
        out = vc_attention(q, k, v)
        vc_attention(q, k, v)
    assert sum("falls back to torch SDPA" in r.message for r in caplog.records) == 1  # once
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, sdpa)


def test_explicit_backend_that_cannot_run_raises_with_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="not a CUDA GPU"):
        vc_attention(q, k, v, backend="triton")


def test_exact_mode_runs_the_reference_under_auto():
    q, k, v = qkv(dtype=torch.float32)
    decision = explain_backend(q, k, v, bits=16)
    assert decision.backend == "reference" and decision.low_bit
    plan = plan_v_smooth(v, num_clusters=4, backend="reference")
    out = vc_attention(q, k, v, bits=16, plan=plan)
    assert rel_l2(out, exact_attention(q, k, v).float()) < 1e-6


def test_causal_and_query_dependent_masks_fall_back_to_sdpa():
    q, k, v = qkv(dtype=torch.float32)
    assert explain_backend(q, k, v, is_causal=True, backend="auto").backend == "sdpa"
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., :10, 30:] = -math.inf
    assert explain_backend(q, k, v, attn_mask=mask).backend == "sdpa"
    out = vc_attention(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out, ref)
    with pytest.raises(RuntimeError, match="causal"):
        vc_attention(q, k, v, is_causal=True, backend="reference")


def test_per_key_bool_mask_becomes_a_key_bias():
    q, k, v = qkv(dtype=torch.float32)
    keep = torch.ones(1, 1, 1, 64, dtype=torch.bool)
    keep[..., 50:] = False
    out = vc_attention(q, k, v, attn_mask=keep, bits=16, backend="reference")
    ref = exact_attention(q, k[:, :, :50], v[:, :, :50]).float()
    assert rel_l2(out, ref) < 1e-6


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("make,err,needle", [
    (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
    (lambda q, k, v: (q, k[:, :, :10], v), ValueError, "same shape"),
    (lambda q, k, v: (q, k[:, :1], v[:, :1]), ValueError, "disagree"),
    (lambda q, k, v: (q, k.float(), v), TypeError, "one dtype"),
    (lambda q, k, v: (q.int(), k, v), TypeError, "floating-point"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, "one device"),
])
def test_bad_tensors_get_clear_errors(make, err, needle):
    q, k, v = qkv()
    with pytest.raises(err, match=needle):
        vc_attention(*make(q, k, v), backend="reference")


@pytest.mark.parametrize("opts,needle", [
    (dict(bits=3), "bits must be"),
    (dict(layout="BNHD"), "layout must be"),
    (dict(backend="cuda"), "backend must be"),
    (dict(sm_scale=-1.0), "sm_scale"),
    (dict(key_bias=torch.zeros(1, 1, 64, 64)), "per key"),
    (dict(key_bias=torch.zeros(1, 1, 1, 63)), "does not broadcast"),
])
def test_bad_options_get_clear_errors(opts, needle):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=needle):
        vc_attention(q, k, v, **opts)


def test_plan_for_another_shape_is_refused():
    q, k, v = qkv()
    plan = plan_v_smooth(torch.randn(1, 2, 65, 64), num_clusters=4, backend="reference")
    with pytest.raises(ValueError, match="new plan"):
        vc_attention(q, k, v, plan=plan, backend="reference")
    with pytest.raises(ValueError, match="v_smooth=True"):
        vc_attention(q, k, v, plan=plan_v_smooth(v, num_clusters=4, backend="reference"),
                     v_smooth=False, backend="reference")


def test_output_keeps_layout_and_dtype_and_inputs_are_untouched():
    for layout in ("HND", "NHD"):
        for dtype in (torch.float16, torch.bfloat16):
            q, k, v = qkv(dtype=dtype, layout=layout)
            before = [t.clone() for t in (q, k, v)]
            out = vc_attention(q, k, v, layout=layout, backend="reference")
            assert out.shape == q.shape and out.dtype == dtype
            assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
            hnd = [t if layout == "HND" else t.transpose(1, 2) for t in (q, k, v)]
            ref = exact_attention(*hnd).float()
            got = out if layout == "HND" else out.transpose(1, 2)
            assert rel_l2(got.float(), ref) < 0.05


# --- torch.compile ----------------------------------------------------------------------------

def test_custom_op_traces_under_torch_compile_without_graph_breaks():
    q, k, v = qkv(dtype=torch.float32)
    plan = plan_v_smooth(v, num_clusters=4, backend="reference")

    def block(q, k, v, perm_source):
        return vc_attention(q * 1.0, k, v, plan=perm_source, backend="reference") + 1.0

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, plan)
    assert torch.allclose(out, block(q, k, v, plan))
    torch.library.opcheck(torch.ops.vc_attention.attention.default,
                          (q, k, v, plan.perm, None, None, False, 8, True, False, 0.125, "HND", "reference"))


def test_second_import_under_another_name_reuses_the_custom_op():
    """ComfyUI imports the pack under its folder name while a pip-installed copy is `vc_attention`:
    the second import must not fail on registering the custom op again."""
    import importlib
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("ComfyUI_VC_Attention_copy", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        copy = importlib.import_module("ComfyUI_VC_Attention_copy.kernels")
        q, k, v = qkv(dtype=torch.float32)
        assert torch.equal(copy.vc_attention(q, k, v, backend="reference"),
                           vc_attention(q, k, v, backend="reference"))
    finally:
        for name in [n for n in sys.modules if n.startswith("ComfyUI_VC_Attention_copy")]:
            del sys.modules[name]
