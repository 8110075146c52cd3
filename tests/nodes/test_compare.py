"""The comparison node on known inputs (PSNR, SSIM, layout of the side-by-side image, errors)."""

import math

import pytest
import torch

from comfy_harness import run_v3


@pytest.fixture(scope="module")
def compare(comfy_nodes):
    return comfy_nodes.NODE_CLASS_MAPPINGS["VCAttentionCompare"]


def frames(n=3, h=32, w=48, value=0.5):
    return torch.full((n, h, w, 3), value)


def test_psnr_of_a_known_offset(compare):
    # A uniform offset d on [0, 1] images: MSE = d^2, PSNR = -20 log10(d): 20 dB for 0.1, 40 dB for 0.01.
    ref = frames()
    test = ref.clone()
    test[0] += 0.1
    test[1] += 0.01
    out = run_v3(compare, reference=ref, test=test, reference_label="BF16", test_label="VC")
    image, mean_psnr, mean_ssim, text = out.args
    # The offsets as float32 actually stored them (0.51 is not exact in float32).
    d = [float((test[i] - ref[i]).double().abs().max()) for i in range(2)]
    expected = [-20 * math.log10(x) for x in d]
    assert expected == pytest.approx([20.0, 40.0], abs=1e-4)
    psnr = [float(v) for v in text.split("per-frame PSNR: ")[1].split()]  # printed to 0.01 dB
    assert psnr[:2] == pytest.approx(expected, abs=0.005)
    assert math.isinf(psnr[2])  # identical frame
    assert mean_psnr == pytest.approx(sum(expected) / 2, abs=1e-9)  # mean over the non-identical frames
    assert "worst 20.00 dB (frame 0)" in text and "1 identical frames" in text
    assert out.ui.as_dict()["text"][0] == text


def test_ssim_is_one_for_identical_and_lower_for_noise(compare):
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(2, 40, 40, 3, generator=g)
    noisy = (ref + 0.2 * torch.randn(ref.shape, generator=g)).clamp(0, 1)
    _, _, same_ssim, _ = run_v3(compare, reference=ref, test=ref.clone()).args
    _, _, noisy_ssim, _ = run_v3(compare, reference=ref, test=noisy).args
    assert same_ssim == pytest.approx(1.0, abs=1e-6)
    assert noisy_ssim < 0.9


def test_side_by_side_layout(compare):
    ref, test = frames(2, 64, 80, 0.25), frames(2, 64, 80, 0.75)
    image = run_v3(compare, reference=ref, test=test).args[0]
    strip = image.shape[1] - 64
    assert image.shape[0] == 2 and image.shape[2] == 2 * 80 + 4 and image.shape[3] == 3 and strip > 0
    assert torch.equal(image[:, strip:, :80], ref)  # reference left, unchanged
    assert torch.equal(image[:, strip:, 84:], test)  # test right
    assert image[:, :strip].max() > 0.5 > image[:, 0, 0].max()  # light text on a dark strip


def test_lpips_is_reported_or_explained(compare):
    text = run_v3(compare, reference=frames(), test=frames(value=0.4)).args[3]
    assert "LPIPS" in text


@pytest.mark.parametrize("test,match", [
    (frames(n=2), "frame counts differ"),
    (frames(h=16), "frame sizes differ"),
    (torch.zeros(3, 32, 48), "IMAGE batch"),
])
def test_mismatched_inputs_are_clear_errors(compare, test, match):
    with pytest.raises(ValueError, match=match):
        run_v3(compare, reference=frames(), test=test)


def test_viewer_payload(compare):
    """The ui output carries what web/vc_attention.js shows: both frame sets as temp PNGs, metrics."""
    import folder_paths
    from PIL import Image

    ref = frames(3, 24, 40, 0.5)
    test = ref.clone()
    test[0] += 0.1
    out = run_v3(compare, reference=ref, test=test, reference_label="A", test_label="B")
    view = out.ui.as_dict()
    _, mean_psnr, _, text = out.args
    assert view["vc_labels"] == ["A", "B"]
    assert view["vc_psnr"][0] == pytest.approx(20.0, abs=1e-3) and view["vc_psnr"][2] is None  # inf -> null
    assert view["vc_psnr"][0] == pytest.approx(mean_psnr)
    assert len(view["vc_ssim"]) == 3 and view["vc_ssim"][2] == pytest.approx(1.0, abs=1e-6)
    for key, x in (("vc_reference", ref), ("vc_test", test)):
        assert len(view[key]) == 3
        for i, entry in enumerate(view[key]):
            assert entry["type"] == "temp"
            path = f"{folder_paths.get_temp_directory()}/{entry['subfolder']}/{entry['filename']}"
            with Image.open(path) as im:
                assert im.size == (40, 24)
                expected = [float(v) * 255 for v in x[i, 0, 0].clamp(0, 1)]  # ComfyUI truncates to uint8
                assert all(abs(a - b) <= 1 for a, b in zip(im.getpixel((0, 0)), expected))


def test_compare_is_an_output_node_that_previews_the_side_by_side(compare):
    """A graph that ends in Compare is accepted (an output node), and its ui output carries the
    side-by-side frames as preview images next to the report text (what /history returns)."""
    import folder_paths
    from PIL import Image

    assert compare.GET_SCHEMA().is_output_node
    ref, test = frames(2, 32, 40, 0.25), frames(2, 32, 40, 0.75)
    out = run_v3(compare, reference=ref, test=test)
    image, text = out.args[0], out.args[3]
    view = out.ui.as_dict()
    assert list(view["text"]) == [text]
    assert len(view["images"]) == 2 and view["animated"] == (False,)
    for i, entry in enumerate(view["images"]):
        assert entry["type"] == "temp"
        with Image.open(f"{folder_paths.get_temp_directory()}/{entry['subfolder']}/{entry['filename']}") as im:
            assert im.size == (image.shape[2], image.shape[1])  # the side-by-side, labels included
            x, y = 5, image.shape[1] - 5  # a reference pixel, below the label strip
            assert abs(im.getpixel((x, y))[0] - int(float(image[i, y, x, 0]) * 255)) <= 1
