"""Captured ComfyUI self-attention inputs across steps, and the stale-plan claim of FIDELITY.md.

Runs tests/attention_capture.py's capture (real ComfyUI on the CPU: a tiny random Wan
2.1 model through UNETLoader -> VCAttentionPatch(bits off) -> KSampler) at a small size and checks:

- the capture sees every tagged self-attention call of every step, with the node's step index and
  the sampler's sigma, and q/k/v of the video tokens only;
- the claim pinned from the schedule measurement ("Schedule effect" in FIDELITY.md): the permutation
  planned inside the grouping window (the node's default, 25%) still removes more block energy than
  sequence order at the last step, in every layer.
"""

import pytest
import torch

STEPS = 8
SHAPE = dict(frames=2, height=32, width=32)  # 2 x 16 x 16 = 512 video tokens: 4 V blocks of 128
LAYERS = 2


@pytest.fixture(scope="module")
def captured(comfy_nodes, tmp_path_factory):
    from attention_capture import capture  # tests/attention_capture.py

    return capture(tmp_path_factory.mktemp("capture"), layers=LAYERS, steps=STEPS, cfg=5.0, **SHAPE)


def test_capture_has_every_self_attention_call_of_every_step(captured):
    calls = captured["calls"]
    assert len(calls) == STEPS * LAYERS  # CFG halves batched: one call per layer and step
    assert sorted({c["step"] for c in calls}) == list(range(STEPS))
    assert {c["layer"] for c in calls} == {f"blocks.{i}.self_attn" for i in range(LAYERS)}
    sigmas = captured["sample_sigmas"]
    for c in calls:
        assert c["q"].shape == c["k"].shape == c["v"].shape == (2, 2, 512, 128)  # [B, H, N, D]
        assert c["sigma"] == pytest.approx(sigmas[c["step"]], rel=1e-5)
        assert torch.isfinite(c["v"]).all()


def test_window_plan_still_beats_sequence_order_at_the_last_step(captured):
    from vc_attention.kernels.fidelity.schedule import SCHEDULES, Planner, energy_share

    in_window, refresh = SCHEDULES["window25"]
    planner = Planner(in_window, refresh, captured["window_sigma"])
    last = STEPS - 1
    checked = 0
    for c in sorted(captured["calls"], key=lambda c: (c["step"], c["block_index"])):
        plan, plan_step = planner.plan((c["layer"], c["cond_or_uncond"]), c["step"], c["sigma"], c["v"])
        if c["step"] != last:
            continue
        assert c["sigma"] < captured["window_sigma"] and plan_step < last  # a stale plan, from the window
        stale = energy_share(c["v"], plan.perm).mean().item()
        sequential = energy_share(c["v"], None).mean().item()
        assert stale > 1.05 * sequential, (c["layer"], stale, sequential)
        checked += 1
    assert checked == LAYERS
