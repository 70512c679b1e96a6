"""What the operating system says about GPUs, the CUDA Toolkit and cuDNN: the doctor's per-OS sources.

Display adapters come from each OS's own list (Windows: ``Win32_VideoController`` through PowerShell;
macOS: ``system_profiler SPDisplaysDataType``; Linux: ``/sys/class/drm``), ``nvidia-smi`` is also looked
for where the Windows driver installs it, ``nvcc --version`` gives the Toolkit's CUDA, and cuDNN libraries
on ``PATH`` / ``LD_LIBRARY_PATH`` are found by name. Everything goes through a ``Probe``, so tests feed it
recorded outputs (tests/recorded/) and a fake OS. No command raises: a missing or hung tool is evidence.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.common.messages import brief

PCI_VENDORS = {"0x10de": "NVIDIA", "0x1002": "AMD", "0x8086": "Intel"}
# The words by which each OS names a GPU's maker (Windows' AdapterCompatibility, macOS' spdisplays_vendor)
VENDOR_WORDS = {
    "NVIDIA": ("nvidia", "geforce", "quadro", "tesla"),
    "AMD": ("amd", "advanced micro devices", "radeon", "ati technologies"),
    "Intel": ("intel",),
    "Apple": ("apple",),
    "Microsoft": ("microsoft basic",),  # Windows' stand-in for a GPU whose driver is not installed
}
POWERSHELL_ADAPTERS = (
    "Get-CimInstance Win32_VideoController | Select-Object Name,AdapterCompatibility,DriverVersion | ConvertTo-Json"
)


@dataclass(frozen=True)
class Ran:
    """One command's outcome: its standard output, or why there is none."""

    argv: tuple[str, ...]
    output: str = ""
    error: str | None = None  # "not found", "timed out after 5 s", "exit status 1: <stderr>"

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Probe:
    """The machine as the doctor reads it: OS name, environment, commands and files.

    The real one runs commands and reads the real files; tests subclass it to return recorded
    outputs, pretend to be Windows or macOS, and move ``root`` (where ``/sys`` and ``/dev`` are
    read) to a temporary folder.
    """

    system: str = field(default_factory=platform.system)  # "Linux", "Windows", "Darwin"
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    root: Path = Path("/")
    timeout_s: float = 5.0  # PowerShell and system_profiler take 1-2 s cold; a hung one costs this much

    def run(self, argv: list[str], *, timeout_s: float | None = None) -> Ran:
        """Run ``argv``; never raises (a hung tool is killed at the timeout and reported as such)."""
        limit = timeout_s or self.timeout_s
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=limit
            )
        except FileNotFoundError:
            return Ran(tuple(argv), error="not found")
        except subprocess.TimeoutExpired:
            return Ran(tuple(argv), error=f"timed out after {limit:g} s")
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            return Ran(tuple(argv), error=brief(err))
        if done.returncode != 0:
            said = " ".join((done.stderr or done.stdout).split())[:200]
            return Ran(tuple(argv), done.stdout, f"exit status {done.returncode}: {said}")
        return Ran(tuple(argv), done.stdout)

    def which(self, name: str) -> str | None:
        return shutil.which(name, path=self.environ.get("PATH", ""))

    def path(self, absolute: str) -> Path:
        """A Linux path (``/sys/class/drm``) under ``root``."""
        return self.root / absolute.lstrip("/")

    def path_dirs(self, variable: str) -> list[str]:
        """The folders of a search-path variable, split the way this OS splits it."""
        separator = ";" if self.system == "Windows" else ":"
        return [d for d in self.environ.get(variable, "").split(separator) if d]

    def os_version(self) -> str:
        if self.system == "Darwin":
            return platform.mac_ver()[0]
        if self.system == "Windows":
            return f"{platform.release()} ({platform.version()})"
        return platform.release()

    def machine(self) -> str:
        return platform.machine()


def vendor_of(adapter: str) -> str:
    """The maker in an adapter's description ("NVIDIA", "AMD", "Intel", "Apple", "Microsoft"), or ""."""
    text = adapter.lower()
    for vendor, words in VENDOR_WORDS.items():
        if any(word in text for word in words):
            return vendor
    return ""


# Display adapters


def display_adapters(probe: Probe) -> tuple[list[str], str, str | None]:
    """(adapters, the source they came from, why the source could not be read or None)."""
    if probe.system == "Windows":
        ran = probe.run(["powershell", "-NoProfile", "-Command", POWERSHELL_ADAPTERS])
        source = "Win32_VideoController"
        if not ran.ok:
            return [], source, f"powershell: {ran.error}"
        try:
            return parse_win32_video(ran.output), source, None
        except ValueError as err:
            return [], source, f"powershell printed no adapter list ({err})"
    if probe.system == "Darwin":
        source = "system_profiler SPDisplaysDataType"
        ran = probe.run(["system_profiler", "SPDisplaysDataType", "-json"])
        if ran.ok:
            with_json = _try(parse_system_profiler_json, ran.output)
            if with_json is not None:
                return with_json, source, None
        text = probe.run(["system_profiler", "SPDisplaysDataType"])  # macOS before 10.15 has no -json
        if not text.ok:
            return [], source, f"system_profiler: {text.error}"
        return parse_system_profiler_text(text.output), source, None
    return drm_adapters(probe.path("/sys/class/drm")), "/sys/class/drm", None


def parse_win32_video(text: str) -> list[str]:
    """``ConvertTo-Json`` of Win32_VideoController: one object for one adapter, a list for several.

    Raises:
        ValueError: the text is not such JSON (PowerShell printed an error, or nothing).
    """
    text = text.strip().lstrip("\ufeff")
    if not text:
        return []  # no adapter at all: ConvertTo-Json of nothing prints nothing
    document = json.loads(text)  # json.JSONDecodeError is a ValueError
    rows = [document] if isinstance(document, dict) else document
    if not isinstance(rows, list):
        raise ValueError(f"expected an object or a list, got {type(rows).__name__}")
    adapters = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        name = str(row.get("Name") or "unnamed adapter")
        detail = ", ".join(
            part
            for part in (str(row.get("AdapterCompatibility") or ""), f"driver {row.get('DriverVersion') or '?'}")
            if part
        )
        adapters.append(f"{name} ({detail})")
    return adapters


def parse_system_profiler_json(text: str) -> list[str]:
    """``system_profiler SPDisplaysDataType -json``: each GPU's ``sppci_model`` and ``spdisplays_vendor``."""
    gpus = json.loads(text).get("SPDisplaysDataType", [])
    return [
        _mac_adapter(gpu.get("sppci_model") or gpu.get("_name", "?"), gpu.get("spdisplays_vendor", "")) for gpu in gpus
    ]


def parse_system_profiler_text(text: str) -> list[str]:
    """The text form: a "Chipset Model:" line per GPU, its "Vendor:" line after it."""
    adapters: list[str] = []
    model = None
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "Chipset Model":
            if model:
                adapters.append(_mac_adapter(model, ""))
            model = value.strip()
        elif key == "Vendor" and model:
            adapters.append(_mac_adapter(model, value.strip()))
            model = None
    if model:
        adapters.append(_mac_adapter(model, ""))
    return adapters


def _mac_adapter(model: str, vendor: str) -> str:
    """ "AMD Radeon Pro 5500M (AMD)" from "sppci_vendor_amd", "Apple M2 (Apple)" from "Apple (0x106b)"."""
    raw = re.sub(r"\s*\(0x[0-9a-f]+\)", "", vendor.removeprefix("sppci_vendor_"), flags=re.IGNORECASE)
    maker = vendor_of(raw) or vendor_of(model) or raw
    return f"{model} ({maker})" if maker else model


def drm_adapters(drm: Path) -> list[str]:
    adapters = []
    try:
        vendor_files = sorted(drm.glob("card[0-9]*/device/vendor"))
    except OSError:
        return []
    for vendor_file in vendor_files:
        if "-" in vendor_file.parent.parent.name:
            continue  # connectors (card0-HDMI-A-1) repeat their card
        try:
            vendor = vendor_file.read_text().strip()
        except OSError:
            continue
        adapters.append(f"{vendor_file.parent.parent.name}: {PCI_VENDORS.get(vendor, vendor)}")
    return adapters


def _try(parse: Any, text: str) -> list[str] | None:
    try:
        return parse(text)
    except (ValueError, AttributeError, TypeError):  # not JSON, or JSON of another shape
        return None


# nvidia-smi, PRIME


def find_nvidia_smi(probe: Probe) -> tuple[str | None, bool]:
    """(its path, whether it is on PATH). The Windows driver installs it where PATH may not reach."""
    found = probe.which("nvidia-smi")
    if found or probe.system != "Windows":
        return found, bool(found)
    for candidate in windows_smi_paths(probe.environ):
        if candidate.is_file():
            return str(candidate), False
    return None, False


def windows_smi_paths(environ: Mapping[str, str]) -> list[Path]:
    """Where drivers since 2019 (DCH: System32) and before (NVSMI under Program Files) put nvidia-smi.exe."""
    system_root = environ.get("SystemRoot") or environ.get("SYSTEMROOT") or r"C:\Windows"
    program_files = environ.get("ProgramFiles") or environ.get("PROGRAMFILES") or r"C:\Program Files"
    return [
        Path(system_root) / "System32" / "nvidia-smi.exe",
        Path(program_files) / "NVIDIA Corporation" / "NVSMI" / "nvidia-smi.exe",
    ]


def prime_profile(probe: Probe) -> str | None:
    """``prime-select query`` (Ubuntu's nvidia-prime: nvidia, on-demand or intel), None without it."""
    if probe.system != "Linux" or not probe.which("prime-select"):
        return None
    ran = probe.run(["prime-select", "query"])
    return ran.output.strip() if ran.ok else f"unknown ({ran.error})"


# The CUDA Toolkit


@dataclass
class Toolkit:
    nvcc: str | None = None  # the nvcc that was run
    cuda: str | None = None  # "11.6"
    build: str | None = None  # "11.6.124"
    env: dict[str, str] = field(default_factory=dict)  # CUDA_PATH / CUDA_HOME as set
    error: str | None = None


def find_toolkit(probe: Probe) -> Toolkit:
    """nvcc on PATH, else under CUDA_PATH / CUDA_HOME; nothing is run when neither exists."""
    toolkit = Toolkit(env={k: probe.environ[k] for k in ("CUDA_PATH", "CUDA_HOME") if probe.environ.get(k)})
    toolkit.nvcc = probe.which("nvcc")
    if not toolkit.nvcc:
        name = "nvcc.exe" if probe.system == "Windows" else "nvcc"
        homes = [Path(v) / "bin" / name for v in toolkit.env.values()]
        toolkit.nvcc = next((str(p) for p in homes if p.is_file()), None)
        if not toolkit.nvcc:
            if toolkit.env:
                toolkit.error = "no nvcc on PATH, nor in bin/ of " + ", ".join(
                    f"{k}={v}" for k, v in toolkit.env.items()
                )
            return toolkit
    ran = probe.run([toolkit.nvcc, "--version"])
    if not ran.ok:
        toolkit.error = f"nvcc --version: {ran.error}"
        return toolkit
    toolkit.cuda, toolkit.build = parse_nvcc(ran.output)
    if toolkit.cuda is None:
        toolkit.error = "nvcc --version printed no 'release X.Y': " + " ".join(ran.output.split())[:120]
    return toolkit


def parse_nvcc(text: str) -> tuple[str | None, str | None]:
    """("11.6", "11.6.124") from "Cuda compilation tools, release 11.6, V11.6.124"."""
    match = re.search(r"release (\d+\.\d+)(?:, V([\d.]+))?", text)
    return (match.group(1), match.group(2)) if match else (None, None)


# cuDNN outside torch


def cudnn_text(version: int | None) -> str | None:
    """torch.backends.cudnn.version() as text: 90100 -> "9.1.0"; 8902 -> "8.9.2" (cuDNN 8 counted in thousands)."""
    if not version:
        return None
    if version >= 10000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def cudnn_file_version(name: str) -> str | None:
    """The version in a cuDNN library's file name: cudnn64_8.dll -> "8", libcudnn.so.8.9.2 -> "8.9.2"."""
    match = re.search(r"\.so\.(\d+(?:\.\d+)*)$", name) or re.search(r"_(\d+)\.dll$", name, re.IGNORECASE)
    return match.group(1) if match else None


def shadowing_cudnn(probe: Probe, own: list[Path]) -> list[dict[str, Any]]:
    """cuDNN libraries in search-path folders other than torch's ``own``, one record per folder.

    Windows searches PATH for DLLs; on Linux LD_LIBRARY_PATH comes before the RUNPATH by which
    torch finds its bundled cuDNN, so a cuDNN there is loaded instead of torch's.
    """
    if probe.system == "Windows":
        variable, pattern = "PATH", "cudnn*.dll"
    elif probe.system == "Linux":
        variable, pattern = "LD_LIBRARY_PATH", "libcudnn*.so*"
    else:
        return []  # macOS: no CUDA, no cuDNN
    mine = {_resolved(p) for p in own}
    found = []
    for folder in dict.fromkeys(probe.path_dirs(variable)):
        path = Path(folder)
        if _resolved(path) in mine:
            continue
        try:
            files = sorted(p.name for p in path.glob(pattern))
        except OSError:
            continue
        if not files:
            continue
        versions = [v for v in map(cudnn_file_version, files) if v]
        # the most precise name tells the most: libcudnn.so.8.9.2 over libcudnn.so.8
        version = max(versions, key=lambda v: [len(v.split("."))] + [int(x) for x in v.split(".")], default=None)
        found.append({"folder": folder, "variable": variable, "files": files, "version": version})
    return found


def _resolved(path: Path) -> str:
    try:
        return str(path.resolve())
    except OSError:
        return str(path)
