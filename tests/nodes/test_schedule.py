"""Schedule logic alone: steps from sigmas, the grouping window, when a layer groups."""

import pytest


@pytest.fixture(scope="module")
def sched(comfy_nodes):
    from vc_attention.nodes import schedule

    return schedule


def groups(sched, steps, window_steps, refresh):
    """Drive plan_action over a sequence of call steps; return the steps that grouped."""
    last, out = None, []
    for s in steps:
        action = sched.plan_action(last, s, s < window_steps, refresh)
        if action is not sched.PlanAction.REUSE:
            out.append((s, action.value))
            last = s
    return out


def flow_sampling(shift: float):
    """ComfyUI's real flow-matching model_sampling (as Wan's) with the given shift."""
    import comfy.model_sampling

    class FlowConfig:
        sampling_settings = {"shift": shift, "multiplier": 1000}

    class Sampling(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
        pass

    return Sampling(FlowConfig())


def test_paper_schedule_wan_40_steps(sched):
    # METHOD.md: Wan 40 steps, first 25% (steps 0-9), every 4 steps -> 0, 4, 8.
    assert groups(sched, range(40), 10, 4) == [(0, "cold"), (4, "warm"), (8, "warm")]


def test_paper_schedule_longcat_50_steps(sched):
    # 25% of 50 = 12.5 -> steps 0-12 -> 0, 4, 8, 12.
    assert [s for s, _ in groups(sched, range(50), 13, 4)] == [0, 4, 8, 12]


def test_heun_two_calls_per_step_group_once(sched):
    calls = [s for i in range(20) for s in (i, i + 1)]  # Heun: sigma_i, then sigma_{i+1}
    assert [s for s, _ in groups(sched, calls, 10, 4)] == [0, 4, 8]


def test_caching_node_skipping_a_step_moves_the_refresh(sched):
    calls = [s for s in range(40) if s not in (4, 5)]  # a cache skipped steps 4 and 5
    assert [s for s, _ in groups(sched, calls, 10, 4)] == [0, 6]


def test_first_call_after_window_groups_once(sched):
    # The second Wan 2.2 expert: first called at step 20 of 40, window is steps 0-9.
    assert groups(sched, range(20, 40), 10, 4) == [(20, "cold")]


def test_step_index(sched):
    sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [sched.step_index(s, sigmas) for s in sigmas[:-1]] == [0, 1, 2, 3]
    assert sched.step_index(0.6, sigmas) == 1  # a midpoint (DPM2, Heun-type) belongs to its step
    assert sched.step_index(0.75 * (1 + 2e-7), sigmas) == 1  # float32 rounding above an entry
    assert sched.step_index(0.75 * (1 - 2e-7), sigmas) == 1  # and below it
    assert sched.step_index(1.5, sigmas) == 0  # above the schedule (restart samplers)
    assert sched.step_index(0.3, []) == 0


def test_window_is_first_quarter_of_simple_schedule(comfy_nodes, sched):
    """With a real flow model_sampling (shift 8, as Wan) and ComfyUI's "simple" scheduler."""
    import comfy.samplers

    ms = flow_sampling(8.0)
    for steps, window, expected in ((40, 0.25, list(range(10))), (50, 0.25, list(range(13))),
                                    (12, 0.5, list(range(6)))):
        sigmas = comfy.samplers.calculate_sigmas(ms, "simple", steps)
        run = sched.RunSchedule.for_run(sched.ScheduleConfig(window, 4), sigmas, ms)
        inside = [i for i, s in enumerate(sigmas[:-1].tolist()) if run.in_window(s)]
        assert inside == expected, (steps, window)
        assert [run.step(s) for s in sigmas[:-1].tolist()] == list(range(steps))
    # Slicing the schedule (KSamplerAdvanced) does not move the window: it is a sigma.
    sigmas = comfy.samplers.calculate_sigmas(ms, "simple", 40)
    run = sched.RunSchedule.for_run(sched.ScheduleConfig(0.25, 4), sigmas[5:], ms)
    assert [i + 5 for i, s in enumerate(sigmas[5:-1].tolist()) if run.in_window(s)] == list(range(5, 10))


def test_window_zero_and_bf16_until(comfy_nodes, sched):
    ms = flow_sampling(1.0)
    run = sched.RunSchedule.for_run(sched.ScheduleConfig(0.0, 4, bf16_until=0.5), [1.0, 0.5, 0.0], ms)
    assert not run.in_window(1.0)
    assert run.keep_default(0.9) and not run.keep_default(0.5) and not run.keep_default(0.2)


@pytest.mark.parametrize("kwargs", [dict(grouping_window=1.5), dict(refresh_every=0), dict(bf16_until=-0.1)])
def test_config_rejects_bad_values(sched, kwargs):
    with pytest.raises(ValueError):
        sched.ScheduleConfig(**kwargs)


def test_kept_plan_is_a_quarter_of_the_plan_and_gives_the_same_permutation(sched):
    """The run keeps one plan per layer and CFG batch: int32 permutation, no labels."""
    import torch

    from vc_attention.kernels import plan_v_smooth

    v = torch.randn(2, 3, 300, 64)
    plan = plan_v_smooth(v, num_clusters=8, iters=3, backend="reference")
    cache = sched.PlanCache()
    cache.put("layer", plan, step=0)
    entry = cache.get("layer")
    # Per token (what grows with N; the centroids are C x D per head): 4 bytes kept instead of 16.
    assert entry.perm.dtype == torch.int32 and not hasattr(entry, "labels")
    assert 4 * entry.perm.nbytes == plan.perm.nbytes + plan.labels.nbytes
    reused = entry.plan
    assert reused.perm.dtype == torch.int32 and torch.equal(reused.perm.long(), plan.perm)  # as the kernels take it
    assert torch.equal(reused.centroids, plan.centroids) and reused.labels is None
    warm = plan_v_smooth(v, num_clusters=8, iters=2, init=entry.centroids, backend="reference")
    assert torch.equal(warm.perm, plan_v_smooth(v, num_clusters=8, iters=2, init=plan, backend="reference").perm)
