"""Dense peak TFLOP/s of NVIDIA GPUs per dtype: the denominator of model FLOPs utilisation (MFU).

    peak = gpu_peak(torch.cuda.get_device_name(index))
    if peak is None:
        notes.append(unknown_reason(name))  # no MFU, and one sentence says why
    elif dtype in peak.tflops:
        mfu = achieved_flop_per_s / (peak.tflops[dtype] * 1e12)

A figure is the chip's dense peak for the dtype the run computes in. ``fp32`` is the CUDA cores' FP32 FMA rate;
``tf32``, ``bf16``, ``fp16`` and ``fp8`` are tensor-core rates without 2:4 sparsity (datasheets that print "with
sparsity" are halved here) and with FP32 accumulation, which is what autocast matmuls use and which GeForce cards up
to Ada run at half speed. A dtype the hardware does not compute (V100: no bf16; GTX 16xx: no tensor cores) is absent,
so the run reports no MFU for it rather than one against another dtype's peak.

A device name matches an entry only whole (case, spaces, hyphens and a leading "NVIDIA"/"Tesla" aside): "RTX 4080" is
not "RTX 4080 SUPER", "H100 PCIe" is not the SXM card, and a name the table does not hold gets ``None``, never the
nearest card (an unknown card read against the A100's peak once reported 88% for a true 12%). The figures are NVIDIA's
rated ones; a card boosting above its rated clock can beat them, one held back by its power limit cannot reach them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class GpuPeak:
    """One card's dense peak TFLOP/s per dtype and where the figures come from.

    Attributes:
        card: The name people use, e.g. "H100 SXM" or "GeForce RTX 4090 Laptop".
        tflops: Dense peak TFLOP/s for each dtype in ``DTYPES`` that the card's hardware computes.
        source: The document(s) the figures come from, and how a figure was derived if it was.
        note: What a reader of the MFU should know, e.g. that a laptop's figure is the top of a clock range.
        names: The device names torch reports for this card, compared whole (see ``matches``).
    """

    card: str
    tflops: Mapping[str, float]
    source: str
    note: str = ""
    names: tuple[str, ...] = ()

    def matches(self, device_name: str) -> bool:
        """Whether ``device_name`` is one of this card's names, up to case, spaces, hyphens and vendor prefix."""
        return _tokens(device_name) in {_tokens(name) for name in self.names}


def _tokens(device_name: str) -> tuple[str, ...]:
    # Whole tokens, so "4080" never matches inside "4080 SUPER" nor "A10" inside "A100". Drivers vary the vendor
    # prefix ("GeForce RTX 2080 Ti" on old ones, "Tesla T4") and never the model.
    words = [word for word in re.split(r"[\s_-]+", device_name.strip().lower()) if word]
    while words and words[0] in ("nvidia", "tesla"):
        words.pop(0)
    if words and words[-1] == "gpu":
        words.pop()
    return tuple(words)


def _card(card: str, names: str, source: str, note: str = "", **tflops: float) -> GpuPeak:
    """An entry read from a datasheet; ``names`` is "|"-separated."""
    return GpuPeak(card, MappingProxyType(tflops), source, note, tuple(names.split("|")))


# --- Data centre: figures read from NVIDIA's datasheets ---------------------------------------------------------------
_HALVED = "tensor figures are the datasheet's 'with sparsity' ones halved"
_V100 = (
    "NVIDIA V100 Tensor Core GPU datasheet, "
    "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf; "
    "fp16 is its 'Tensor Performance' (FP16 multiply, FP32 accumulate)"
)
_T4 = (
    "NVIDIA T4 Tensor Core GPU datasheet, "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf; "
    "fp16 is its 'Mixed Precision (FP16/FP32)'"
)
_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (dense figures; the same for every form factor and memory size)"
)
_A10 = (
    "NVIDIA A10 Tensor Core GPU datasheet, "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf (dense figures)"
)
_A30 = (
    "NVIDIA A30 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/products/a30-gpu/ (dense figures)"
)
_L4 = f"NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/; {_HALVED}"
_L40 = "NVIDIA L40 GPU datasheet, https://www.nvidia.com/en-us/data-center/l40/ (dense figures; TF32 at the FP32 rate)"
_L40S = "NVIDIA L40S GPU datasheet, https://www.nvidia.com/en-us/data-center/l40s/ (dense figures)"
_H100 = f"NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/; {_HALVED}"
_H200 = f"NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/; {_HALVED}"
_B200 = f"NVIDIA HGX B200 specifications, individual GPU, https://www.nvidia.com/en-us/data-center/hgx/; {_HALVED}"
_A100_FIGURES = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
_HOPPER_SXM = {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0}
_HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}
# NVIDIA's PCIe/NVL figures imply a tensor clock below the card's maximum boost (835.5 over 132 SMs is ~1.55 GHz; an
# H200 NVL boosts to 1,785 MHz, and an mma.sync benchmark measured 978 dense BF16 TFLOP/s on an H100 NVL), so MFU here
# can read high when the card has power to spare.
_RATED_LOW = "NVIDIA rates this card's tensor peak below its maximum boost clock; an unthrottled card can beat it"

_DATA_CENTRE = (
    _card("V100 SXM2", "Tesla V100-SXM2-16GB|Tesla V100-SXM2-32GB", _V100, fp32=15.7, fp16=125.0),
    _card("V100 PCIe", "Tesla V100-PCIE-16GB|Tesla V100-PCIE-32GB", _V100, fp32=14.0, fp16=112.0),
    _card("V100S PCIe", "Tesla V100S-PCIE-32GB", _V100, fp32=16.4, fp16=130.0),
    _card("T4", "Tesla T4", _T4, fp32=8.1, fp16=65.0),
    _card("A100 SXM4 40GB", "A100-SXM4-40GB", _A100, **_A100_FIGURES),
    _card("A100 SXM4 80GB", "A100-SXM4-80GB|A100-SXM-80GB", _A100, **_A100_FIGURES),
    _card("A100 PCIe 40GB", "A100-PCIE-40GB", _A100, **_A100_FIGURES),
    _card("A100 PCIe 80GB", "A100 80GB PCIe|A100-PCIE-80GB", _A100, **_A100_FIGURES),
    # A bare "A100" is no guess: the datasheet gives every A100 the same figures.
    _card("A100 (form factor not reported)", "A100", _A100, "every A100 variant has these figures", **_A100_FIGURES),
    _card("A10", "A10", _A10, fp32=31.2, tf32=62.5, bf16=125.0, fp16=125.0),
    _card("A30", "A30", _A30, fp32=10.3, tf32=82.0, bf16=165.0, fp16=165.0),
    _card("L4", "L4", _L4, fp32=30.3, tf32=60.0, bf16=121.0, fp16=121.0, fp8=242.5),
    _card("L40", "L40", _L40, fp32=90.5, tf32=90.5, bf16=181.05, fp16=181.05, fp8=362.0),
    _card("L40S", "L40S", _L40S, fp32=91.6, tf32=183.0, bf16=362.05, fp16=362.05, fp8=733.0),
    # The H100 whitepaper's dense table has 66.9 / 494.7 / 989.4 / 1978.9 for the SXM5 card: the same within rounding.
    _card("H100 SXM", "H100 80GB HBM3|H100 SXM5 80GB", _H100, **_HOPPER_SXM),
    _card("H100 PCIe", "H100 PCIe", _H100, _RATED_LOW, fp32=51.0, tf32=378.0, bf16=756.5, fp16=756.5, fp8=1513.0),
    _card("H100 NVL", "H100 NVL", _H100, _RATED_LOW, **_HOPPER_NVL),
    _card("H200 SXM", "H200", _H200, **_HOPPER_SXM),
    _card("H200 NVL", "H200 NVL", _H200, _RATED_LOW, **_HOPPER_NVL),
    # Per GPU at HGX B200's 1,000 W; TF32 is printed as 2.2 PFLOPS with sparsity, so 1,100 dense.
    _card("B200", "B200", _B200, fp32=75.0, tf32=1100.0, bf16=2250.0, fp16=2250.0, fp8=4500.0),
)

# --- GeForce: NVIDIA gives CUDA cores and a boost clock; fp32 = 2 x cores x boost (an FMA is 2 FLOPs) -----------------
# Each architecture's dense tensor rate over its FP32 rate, per SM per clock, read off the whitepaper's GeForce table.
_TURING = (
    "NVIDIA Turing GPU Architecture whitepaper, Appendix A (RTX 2080 Ti Founders Edition: FP32 14.2, FP16 tensor with "
    "FP32 accumulate 56.9 TFLOPS, so 4 x FP32), https://images.nvidia.com/aem-dam/en-zz/Solutions/design-visualization/"
    "technologies/turing-architecture/NVIDIA-Turing-Architecture-Whitepaper.pdf"
)
_AMPERE = (
    "NVIDIA Ampere GA102 GPU Architecture whitepaper, Appendix A (RTX 3090: FP32 35.6, TF32 tensor 35.6, FP16/BF16 "
    "tensor with FP32 accumulate 71 TFLOPS), https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-"
    "whitepaper-v2.pdf"
)
_ADA = (
    "NVIDIA Ada GPU Architecture whitepaper, Appendix A (RTX 4090: FP32 82.6, TF32 tensor 82.6, FP16/BF16 tensor with "
    "FP32 accumulate 165.2, FP8 tensor with FP32 accumulate 330.3 TFLOPS), "
    "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
)
# NVIDIA's RTX 50 pages give AI TOPS (FP4 with sparsity): 32 x the FP32 rate on every desktop card. Its FP16 figure for
# the RTX 5090 (838 with sparsity) halves to 419 = 4 x FP32; that this holds with FP32 accumulate rests on a
# measurement, not a table, and it errs low: the halved 209.5 cannot be right where 370 was measured.
_BLACKWELL = (
    "NVIDIA GeForce RTX 50 Series specifications, https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/: AI "
    "TOPS (FP4 with sparsity) is 32 x FP32 on every desktop card (RTX 5090: 3,352 = 32 x 104.8); FP16/BF16 tensor = "
    "AI TOPS / 8 = 4 x FP32 (RTX 5090: 419, NVIDIA's FP16 838 with sparsity halved), kept with FP32 accumulate since "
    "an mma.sync microbenchmark (mmapeak) measured 370 TFLOPS FP16/BF16 with FP32 accumulate on an RTX 5090, and TF32 "
    "at the FP32 rate (93 measured in the same run); FP8 left out: its rate with FP32 accumulate is not documented"
)
_GTX16 = (
    "no tensor cores; fp16 left out: the CUDA cores' double-rate FP16 accumulates in FP16, autocast matmuls accumulate "
    "in FP32"
)
_ARCH = {  # architecture: (tensor rates over fp32, the document that says so, NVIDIA's specification page)
    "gtx16": ({}, _GTX16, "https://www.nvidia.com/en-us/geforce/graphics-cards/compare/"),
    "turing": ({"fp16": 4.0}, _TURING, "https://www.nvidia.com/en-us/geforce/graphics-cards/compare/"),
    "ampere": (
        {"tf32": 1.0, "bf16": 2.0, "fp16": 2.0},
        _AMPERE,
        "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/",
    ),
    "ada": (
        {"tf32": 1.0, "bf16": 2.0, "fp16": 2.0, "fp8": 4.0},
        _ADA,
        "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/",
    ),
    "blackwell": (
        {"tf32": 1.0, "bf16": 4.0, "fp16": 4.0},
        _BLACKWELL,
        "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/",
    ),
}
_LAPTOPS = "https://www.nvidia.com/en-us/geforce/gaming-laptops/compare/"


def _fe(reference_mhz: int) -> str:
    return f"the Founders Edition's boost clock; MFU of a card at the reference {reference_mhz} MHz reads low"


def _geforce(model: str, arch: str, cores: int, mhz: int, *, low_mhz: int = 0, note: str = "") -> GpuPeak:
    """A GeForce entry derived from its CUDA cores and boost clock; ``low_mhz`` marks a laptop's boost-clock range."""
    ratios, document, page = _ARCH[arch]
    fp32 = 2 * cores * mhz / 1e6
    tflops = {"fp32": round(fp32, 2)} | {dtype: round(ratio * fp32, 2) for dtype, ratio in ratios.items()}
    page = _LAPTOPS if low_mhz else page
    source = f"derived: 2 x {cores} CUDA cores x {mhz} MHz boost (NVIDIA specifications, {page}); ratios: {document}"
    if low_mhz:
        note = (
            f"laptop: the top of NVIDIA's {low_mhz}-{mhz} MHz boost range; a lower power limit runs slower, so MFU "
            "against it is a lower bound"
        )
    elif arch in ("gtx16", "turing"):  # their laptops report the desktop name ("with Max-Q Design" aside)
        note = "; ".join(filter(None, (note, "a laptop reporting this name clocks lower, so its MFU reads low")))
    card = f"GeForce {model}"
    return GpuPeak(card, MappingProxyType(tflops), source, note, (f"{card} GPU" if low_mhz else card,))


def _laptop_50(model: str, cores: int, ai_tops: int) -> GpuPeak:
    """An RTX 50 laptop entry from NVIDIA's AI TOPS, the compute figure its laptop specifications give."""
    fp32 = ai_tops / 32
    tflops = {"fp32": fp32, "tf32": fp32, "bf16": ai_tops / 8, "fp16": ai_tops / 8}
    source = f"derived: NVIDIA's {ai_tops} AI TOPS for the {cores}-core laptop GPU ({_LAPTOPS}); ratios: {_BLACKWELL}"
    implied_mhz = fp32 * 1e6 / (2 * cores)
    note = (
        f"laptop: from NVIDIA's AI TOPS, which implies {implied_mhz:.0f} MHz; a laptop clocking lower (its power limit "
        "decides) runs slower, so MFU against it is a lower bound"
    )
    card = f"GeForce {model}"
    return GpuPeak(card, MappingProxyType(tflops), source, note, (f"{card} GPU",))


_GEFORCE = (
    _geforce("GTX 1650", "gtx16", 896, 1665, note="the GDDR5 card's boost; MFU of the GDDR6 card (1590 MHz) reads low"),
    _geforce("GTX 1650 SUPER", "gtx16", 1280, 1725),
    _geforce("GTX 1660", "gtx16", 1408, 1785),
    _geforce("GTX 1660 SUPER", "gtx16", 1408, 1785),
    _geforce("GTX 1660 Ti", "gtx16", 1536, 1770),
    _geforce("RTX 2060", "turing", 1920, 1680),
    _geforce("RTX 2060 SUPER", "turing", 2176, 1650),
    _geforce("RTX 2070", "turing", 2304, 1710, note=_fe(1620)),
    _geforce("RTX 2070 SUPER", "turing", 2560, 1770),
    _geforce("RTX 2080", "turing", 2944, 1800, note=_fe(1710)),
    _geforce("RTX 2080 SUPER", "turing", 3072, 1815),
    _geforce("RTX 2080 Ti", "turing", 4352, 1635, note=_fe(1545)),
    _geforce(
        "RTX 3050", "ampere", 2560, 1777, note="the 2,560-core card; MFU of the 2,304-core OEM card reads 11% low"
    ),
    _geforce("RTX 3060", "ampere", 3584, 1777),
    _geforce("RTX 3060 Ti", "ampere", 4864, 1665),
    _geforce("RTX 3070", "ampere", 5888, 1725),
    _geforce("RTX 3070 Ti", "ampere", 6144, 1770),
    _geforce("RTX 3080", "ampere", 8960, 1710, note="the 12 GB card; MFU of the 10 GB card (8,704 cores) reads 3% low"),
    _geforce("RTX 3080 Ti", "ampere", 10240, 1665),
    _geforce("RTX 3090", "ampere", 10496, 1695),
    _geforce("RTX 3090 Ti", "ampere", 10752, 1860),
    _geforce("RTX 4060", "ada", 3072, 2460),
    _geforce("RTX 4060 Ti", "ada", 4352, 2535),
    _geforce("RTX 4070", "ada", 5888, 2475),
    _geforce("RTX 4070 SUPER", "ada", 7168, 2475),
    _geforce("RTX 4070 Ti", "ada", 7680, 2610),
    _geforce("RTX 4070 Ti SUPER", "ada", 8448, 2610),
    _geforce("RTX 4080", "ada", 9728, 2505),
    _geforce("RTX 4080 SUPER", "ada", 10240, 2550),
    _geforce("RTX 4090", "ada", 16384, 2520),
    _geforce("RTX 5060", "blackwell", 3840, 2497),
    _geforce("RTX 5060 Ti", "blackwell", 4608, 2572),
    _geforce("RTX 5070", "blackwell", 6144, 2512),
    _geforce("RTX 5070 Ti", "blackwell", 8960, 2452),
    _geforce("RTX 5080", "blackwell", 10752, 2617),
    _geforce("RTX 5090", "blackwell", 21760, 2407),
    # Laptops: torch names them "... Laptop GPU" from the RTX 30 series on; RTX 20 laptops report the desktop name.
    _geforce("RTX 3050 Laptop", "ampere", 2048, 1740, low_mhz=1057),
    _geforce("RTX 3050 Ti Laptop", "ampere", 2560, 1695, low_mhz=1035),
    _geforce("RTX 3060 Laptop", "ampere", 3840, 1703, low_mhz=1283),
    _geforce("RTX 3070 Laptop", "ampere", 5120, 1620, low_mhz=1290),
    _geforce("RTX 3070 Ti Laptop", "ampere", 5888, 1485, low_mhz=1035),
    _geforce("RTX 3080 Laptop", "ampere", 6144, 1710, low_mhz=1245),
    _geforce("RTX 3080 Ti Laptop", "ampere", 7424, 1590, low_mhz=1125),
    _geforce("RTX 4050 Laptop", "ada", 2560, 2370, low_mhz=1605),
    _geforce("RTX 4060 Laptop", "ada", 3072, 2370, low_mhz=1470),
    _geforce("RTX 4070 Laptop", "ada", 4608, 2175, low_mhz=1230),
    _geforce("RTX 4080 Laptop", "ada", 7424, 2280, low_mhz=1350),
    _geforce("RTX 4090 Laptop", "ada", 9728, 2040, low_mhz=1455),
    _laptop_50("RTX 5060 Laptop", 3328, 572),
    _laptop_50("RTX 5070 Laptop", 4608, 798),
    _laptop_50("RTX 5070 Ti Laptop", 5888, 992),
    _laptop_50("RTX 5080 Laptop", 7680, 1334),
    _laptop_50("RTX 5090 Laptop", 10496, 1824),
)
# Left out, so they get None: V100 SXM3/FHHL/DGXS and A10G (no NVIDIA figures found for those variants), RTX 4090 D,
# RTX 5090 D and other export variants, RTX 20 laptops ("with Max-Q Design" boost ranges not found), the RTX 5050
# (desktop and laptop), GH200, B100/B300, and workstation cards (RTX A-series and RTX Ada/Blackwell).

TABLE: tuple[GpuPeak, ...] = _DATA_CENTRE + _GEFORCE


def _index(table: tuple[GpuPeak, ...]) -> dict[tuple[str, ...], GpuPeak]:
    index: dict[tuple[str, ...], GpuPeak] = {}
    for peak in table:
        for name in peak.names:
            other = index.setdefault(_tokens(name), peak)
            if other is not peak:
                raise ValueError(f"gpu_peaks: {name!r} names both {other.card!r} and {peak.card!r}; give it one card")
    return index


_INDEX = _index(TABLE)

# Real names that do not say which card; the variants' peaks differ, so picking one would be a guess.
_AMBIGUOUS = {
    ("h100",): "it does not say which H100 (SXM, PCIe or NVL: 989.5, 756.5 or 835.5 dense BF16 TFLOP/s)",
}


def gpu_peak(device_name: str) -> GpuPeak | None:
    """The entry for a CUDA device name as ``torch.cuda.get_device_name()`` reports it.

    Args:
        device_name: e.g. "NVIDIA H100 80GB HBM3" or "NVIDIA GeForce RTX 3060 Laptop GPU".

    Returns:
        The card's entry, or None for a name the table does not hold (never the nearest other card), for an ambiguous
        name such as a bare "NVIDIA H100", and for a MIG slice, which has only a share of the card's SMs.
    """
    return _INDEX.get(_tokens(device_name))


def unknown_reason(device_name: str) -> str:
    """One sentence for the run's summary when ``gpu_peak(device_name)`` is None; "" when the card is in the table.

    Args:
        device_name: The name ``torch.cuda.get_device_name()`` reported.

    Returns:
        Why there is no MFU, naming the device and what would give one.
    """
    tokens = _tokens(device_name)
    if tokens in _INDEX:
        return ""
    if "mig" in tokens:
        return (
            f"no MFU: {device_name!r} is a MIG slice, which has a share of the card's SMs that pipeline's table of "
            "GPU peaks (src/pipeline/monitor/gpu_peaks.py) does not hold; run on a whole GPU for an MFU"
        )
    if tokens in _AMBIGUOUS:
        return (
            f"no MFU: {device_name!r} is ambiguous, {_AMBIGUOUS[tokens]}; pipeline's table of GPU peaks "
            "(src/pipeline/monitor/gpu_peaks.py) takes the exact name once you know the card"
        )
    return (
        f"no MFU: {device_name!r} is not in pipeline's table of GPU peaks (src/pipeline/monitor/gpu_peaks.py); "
        "add its datasheet's dense figures there"
    )
