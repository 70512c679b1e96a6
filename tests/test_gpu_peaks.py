"""The table of GPU dense peaks: every figure sourced and plausible, names matched whole, unknown cards get None."""

from __future__ import annotations

import re

import pytest

from pipeline.monitor.gpu_peaks import DTYPES, TABLE, GpuPeak, gpu_peak, unknown_reason

# Names torch.cuda.get_device_name() reports (or older drivers did), the card each is, and figures to check.
KNOWN = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp8": 1979.0, "fp32": 67.0}),
    ("NVIDIA H100 PCIe", "H100 PCIe", {"bf16": 756.5, "fp8": 1513.0, "fp32": 51.0}),
    ("NVIDIA H100 NVL", "H100 NVL", {"bf16": 835.5, "fp8": 1670.5}),
    ("NVIDIA H200", "H200 SXM", {"bf16": 989.5, "fp8": 1979.0}),
    ("NVIDIA H200 NVL", "H200 NVL", {"bf16": 835.5}),
    ("NVIDIA B200", "B200", {"bf16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 75.0}),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM4 40GB", {"bf16": 312.0}),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB", {"bf16": 312.0}),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", {"bf16": 312.0}),
    ("Tesla V100-SXM2-16GB", "V100 SXM2", {"fp16": 125.0, "fp32": 15.7}),
    ("Tesla V100-SXM2-32GB", "V100 SXM2", {"fp16": 125.0}),
    ("Tesla V100-PCIE-32GB", "V100 PCIe", {"fp16": 112.0, "fp32": 14.0}),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe", {"fp16": 130.0}),
    ("Tesla T4", "T4", {"fp16": 65.0, "fp32": 8.1}),
    ("NVIDIA A10", "A10", {"bf16": 125.0, "tf32": 62.5}),
    ("NVIDIA A30", "A30", {"bf16": 165.0}),
    ("NVIDIA L4", "L4", {"bf16": 121.0, "fp8": 242.5, "fp32": 30.3}),
    ("NVIDIA L40S", "L40S", {"bf16": 362.05, "fp8": 733.0, "tf32": 183.0}),
    ("NVIDIA L40", "L40", {"bf16": 181.05, "fp8": 362.0}),
    # GeForce, against the architecture whitepapers' own tables (rounded there to 0.1)
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", {"bf16": 165.2, "fp8": 330.3, "tf32": 82.6, "fp32": 82.6}),
    ("NVIDIA GeForce RTX 4080", "GeForce RTX 4080", {"bf16": 97.5, "fp8": 194.9, "fp32": 48.7}),
    ("NVIDIA GeForce RTX 4080 SUPER", "GeForce RTX 4080 SUPER", {"fp32": 52.2}),
    ("NVIDIA GeForce RTX 4070 Ti SUPER", "GeForce RTX 4070 Ti SUPER", {"fp32": 44.1}),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090", {"bf16": 71.2, "tf32": 35.6, "fp32": 35.6}),
    ("NVIDIA GeForce RTX 3070", "GeForce RTX 3070", {"bf16": 40.6, "fp32": 20.3}),
    ("NVIDIA GeForce RTX 3060", "GeForce RTX 3060", {"fp32": 12.7}),
    ("NVIDIA GeForce RTX 3060 Ti", "GeForce RTX 3060 Ti", {"fp32": 16.2}),
    ("NVIDIA GeForce RTX 3060 Laptop GPU", "GeForce RTX 3060 Laptop", {"fp32": 13.1, "bf16": 26.2}),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", "GeForce RTX 4090 Laptop", {"fp32": 39.7}),
    ("NVIDIA GeForce RTX 2080 Ti", "GeForce RTX 2080 Ti", {"fp16": 56.9, "fp32": 14.2}),
    ("GeForce RTX 2080 Ti", "GeForce RTX 2080 Ti", {"fp16": 56.9}),  # drivers before "NVIDIA" prefixed GeForce names
    ("NVIDIA GeForce RTX 2080", "GeForce RTX 2080", {"fp16": 42.4, "fp32": 10.6}),
    ("NVIDIA GeForce RTX 2070", "GeForce RTX 2070", {"fp16": 31.5, "fp32": 7.9}),
    ("NVIDIA GeForce GTX 1660 SUPER", "GeForce GTX 1660 SUPER", {"fp32": 5.0}),
    ("NVIDIA GeForce GTX 1650", "GeForce GTX 1650", {"fp32": 3.0}),
    ("NVIDIA GeForce RTX 5090", "GeForce RTX 5090", {"fp32": 104.8, "tf32": 104.8, "bf16": 419.0}),
    ("NVIDIA GeForce RTX 5090 Laptop GPU", "GeForce RTX 5090 Laptop", {"bf16": 228.0, "fp32": 57.0}),
]

# Torch names of cards the table leaves out, of other vendors, of slices and of nothing at all.
UNKNOWN = [
    "NVIDIA RTX A6000",
    "AMD Instinct MI300X",
    "Some Future GPU",
    "NVIDIA A10G",
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA GeForce RTX 2070 with Max-Q Design",
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
    "NVIDIA H100",
    "NVIDIA H100 80GB",
    "",
]

# GeForce cards from Ampere on, and the L40, run TF32 at the FP32 rate: their datasheets/whitepapers say so.
TF32_AT_FP32_RATE = re.compile(r"^(GeForce RTX [345]0\d0|L40$)")


def close(value: float, expected: float) -> bool:
    # Whitepapers and datasheets print one decimal; a derived figure must land within that rounding.
    return abs(value - expected) <= 0.051 + 1e-4 * expected


@pytest.mark.parametrize(("name", "card", "figures"), KNOWN, ids=[name for name, _, _ in KNOWN])
def test_a_real_device_name_finds_its_card_and_figures(name: str, card: str, figures: dict[str, float]) -> None:
    peak = gpu_peak(name)
    assert peak is not None, unknown_reason(name)
    assert peak.card == card
    for dtype, expected in figures.items():
        assert close(peak.tflops[dtype], expected), (dtype, peak.tflops[dtype], expected)
    assert unknown_reason(name) == ""


@pytest.mark.parametrize("name", ["Tesla V100-SXM2-16GB", "Tesla T4", "NVIDIA GeForce RTX 2080 Ti"])
def test_cards_without_bf16_or_tf32_hardware_have_no_such_figure(name: str) -> None:
    peak = gpu_peak(name)
    assert peak is not None
    assert "bf16" not in peak.tflops
    assert "tf32" not in peak.tflops
    assert "fp8" not in peak.tflops


def test_cards_before_hopper_and_ada_have_no_fp8_figure() -> None:
    for name in ("NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 3090", "NVIDIA A10", "Tesla V100-PCIE-16GB"):
        peak = gpu_peak(name)
        assert peak is not None
        assert "fp8" not in peak.tflops, name


def test_gtx_16_cards_have_only_an_fp32_figure() -> None:
    for peak in TABLE:
        if peak.card.startswith("GeForce GTX 16"):
            assert set(peak.tflops) == {"fp32"}, peak.card


@pytest.mark.parametrize(
    ("name", "card"),
    [
        ("NVIDIA GeForce RTX 4080", "GeForce RTX 4080"),
        ("NVIDIA GeForce RTX 4080 SUPER", "GeForce RTX 4080 SUPER"),
        ("NVIDIA GeForce RTX 3060", "GeForce RTX 3060"),
        ("NVIDIA GeForce RTX 3060 Ti", "GeForce RTX 3060 Ti"),
        ("NVIDIA GeForce RTX 3060 Laptop GPU", "GeForce RTX 3060 Laptop"),
        ("NVIDIA GeForce RTX 4070 Ti", "GeForce RTX 4070 Ti"),
        ("NVIDIA GeForce RTX 4070 Ti SUPER", "GeForce RTX 4070 Ti SUPER"),
        ("NVIDIA GeForce GTX 1660", "GeForce GTX 1660"),
        ("NVIDIA GeForce GTX 1660 Ti", "GeForce GTX 1660 Ti"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
        ("Tesla V100-PCIE-16GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
    ],
)
def test_a_variant_never_takes_its_siblings_entry(name: str, card: str) -> None:
    peak = gpu_peak(name)
    assert peak is not None
    assert peak.card == card


@pytest.mark.parametrize(
    "name",
    ["nvidia geforce rtx 4090", "NVIDIA  GeForce  RTX 4090", "NVIDIA GeForce RTX-4090", " NVIDIA GeForce RTX 4090 "],
)
def test_case_spaces_and_hyphens_do_not_matter(name: str) -> None:
    peak = gpu_peak(name)
    assert peak is not None
    assert peak.card == "GeForce RTX 4090"


def test_tokens_are_whole_so_a_prefix_or_a_longer_name_matches_nothing() -> None:
    assert gpu_peak("NVIDIA GeForce RTX 409") is None
    assert gpu_peak("NVIDIA GeForce RTX 4090 Ti") is None
    assert gpu_peak("NVIDIA A1") is None
    assert gpu_peak("NVIDIA H100 80GB HBM3 MIG 7g.80gb") is None


def test_an_a100_name_without_its_form_factor_gets_the_figures_every_a100_shares() -> None:
    peak = gpu_peak("NVIDIA A100")
    assert peak is not None
    assert dict(peak.tflops) == {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
    assert "every A100" in peak.note
    a100s = [p for p in TABLE if p.card.startswith("A100")]
    assert len(a100s) == 5
    assert all(dict(p.tflops) == dict(peak.tflops) for p in a100s)


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_or_ambiguous_name_gets_none_and_a_reason_that_names_it(name: str) -> None:
    assert gpu_peak(name) is None
    reason = unknown_reason(name)
    assert reason.startswith("no MFU: ")
    assert repr(name) in reason


def test_the_reason_for_a_bare_h100_says_it_is_ambiguous_and_lists_the_variants() -> None:
    reason = unknown_reason("NVIDIA H100")
    assert "ambiguous" in reason
    assert all(figure in reason for figure in ("989.5", "756.5", "835.5"))


def test_the_reason_for_a_mig_slice_says_so() -> None:
    assert "MIG slice" in unknown_reason("NVIDIA A100-SXM4-40GB MIG 1g.5gb")


def test_the_reason_for_an_unknown_card_points_at_this_table() -> None:
    assert unknown_reason("NVIDIA RTX A6000") == (
        "no MFU: 'NVIDIA RTX A6000' is not in pipeline's table of GPU peaks (src/pipeline/monitor/gpu_peaks.py); "
        "add its datasheet's dense figures there"
    )


def test_every_entry_finds_itself_by_each_of_its_names() -> None:
    for peak in TABLE:
        assert peak.names, peak.card
        for name in peak.names:
            assert gpu_peak(name) is peak, name
            assert gpu_peak("NVIDIA " + name) is peak, name


def test_no_two_entries_match_the_same_name() -> None:
    names = [name for name, _, _ in KNOWN] + UNKNOWN + [name for peak in TABLE for name in peak.names]
    for name in names:
        matching = [peak.card for peak in TABLE if peak.matches(name)]
        assert len(matching) <= 1, (name, matching)
    cards = [peak.card for peak in TABLE]
    assert len(cards) == len(set(cards))


def test_every_entry_has_a_source_and_at_least_one_figure_of_a_known_dtype() -> None:
    for peak in TABLE:
        assert isinstance(peak, GpuPeak)
        assert peak.tflops, peak.card
        assert set(peak.tflops) <= set(DTYPES), peak.card
        assert "https://" in peak.source, peak.card
        assert "NVIDIA" in peak.source, peak.card  # names the document, not only a link


def test_every_figure_is_positive_and_plausible() -> None:
    for peak in TABLE:
        figures = peak.tflops
        assert 1.0 < figures["fp32"] < 150.0, peak.card  # every card here has an fp32 figure
        assert all(0.0 < value < 5000.0 for value in figures.values()), peak.card
        if "tf32" in figures:
            if TF32_AT_FP32_RATE.match(peak.card):
                assert figures["tf32"] == figures["fp32"], peak.card
            else:
                assert figures["tf32"] > figures["fp32"], peak.card
        tensor_16 = [figures[dtype] for dtype in ("bf16", "fp16") if dtype in figures]
        if "bf16" in figures:
            assert figures["bf16"] == figures["fp16"], peak.card
            assert figures["bf16"] >= figures.get("tf32", 0.0), peak.card
        if tensor_16:
            assert tensor_16[0] > figures["fp32"], peak.card
        if "fp8" in figures:
            assert figures["fp8"] >= figures["bf16"], peak.card


def test_derived_fp32_reproduces_nvidias_own_rtx_50_ai_tops() -> None:
    # NVIDIA publishes AI TOPS (FP4 with sparsity) for each RTX 50 card: 32 x FP32 per SM and clock; cores x boost
    # must land on it, which checks the cores and clocks typed into the table against an independent figure.
    ai_tops = {"5060": 614, "5060 Ti": 759, "5070": 988, "5070 Ti": 1406, "5080": 1801, "5090": 3352}
    for model, tops in ai_tops.items():
        peak = gpu_peak(f"NVIDIA GeForce RTX {model}")
        assert peak is not None
        assert peak.tflops["fp32"] * 32 == pytest.approx(tops, rel=0.002), model
        assert peak.tflops["bf16"] == pytest.approx(tops / 8, rel=0.002), model


def test_laptops_say_their_figure_is_a_lower_bound() -> None:
    laptops = [peak for peak in TABLE if peak.card.endswith("Laptop")]
    assert len(laptops) == 17
    for peak in laptops:
        assert peak.names == (peak.card + " GPU",), peak.card
        assert peak.note.startswith("laptop: "), peak.card
        assert "lower bound" in peak.note, peak.card


def test_hopper_pcie_and_nvl_cards_warn_that_their_rating_is_below_max_boost() -> None:
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL"):
        peak = gpu_peak(name)
        assert peak is not None
        assert "below its maximum boost" in peak.note


def test_tflops_cannot_be_changed_through_an_entry() -> None:
    peak = gpu_peak("NVIDIA H100 80GB HBM3")
    assert peak is not None
    with pytest.raises(TypeError):
        peak.tflops["bf16"] = 1.0  # type: ignore[index]
