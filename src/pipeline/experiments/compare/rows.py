"""Runs into rows: a row is one configuration *on the same code and software*, its runs the repeats.

``config_key`` is what makes runs repeats of each other: every param but the seed (``REPEAT_KEYS``) and the
bookkeeping keys that change nothing measured (``BOOKKEEPING``), plus the provenance tags (``PROVENANCE``: the
launch folder's git commit and local changes, the pipeline's own code (its version, a hash of its source files, its
clone's commit and changes), torch and CUDA versions, the device). So ``--last N`` across a code
change compares two rows, not a mixture; the provenance that differs is shown (``provenance_columns``) and rows
that differ only there say so (``only_provenance``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.common.metric_names import GPU_MEM_PEAK_MB, MEMORY_MAX_ALLOCATED_MB, OOM_EVENTS
from pipeline.common.stats import Summary, summarize
from pipeline.config import target_label
from pipeline.config.design import REPEAT_KEYS  # runs differing only here are repeats of one configuration
from pipeline.experiments.compare.runs import STEP_PARTS, ComparedRun

# Keys that name, place or watch a run and change nothing it measures: never a reason for two rows.
BOOKKEEPING_PREFIXES = ("tracking.", "monitor.")
BOOKKEEPING = frozenset({"checkpoint.dir", "trainer.progress", "resume", "fork"})
# params with a column of their own (model, batch, workers, resident; amp and its dtype are the precision column)
MODEL_KEYS = ("model._target_", "model.arch", "model.name")  # the model column (model.name: runs before _target_)
LOADER_SHOWN = ("loader.batch_size", "loader.num_workers", "loader.resident")
SHOWN = (*MODEL_KEYS, *LOADER_SHOWN)
COVERED = frozenset({"amp", "precision.dtype"})  # the precision column shows what these decide
# The code and software a run measured, with the column name each gets when it differs between rows.
PROVENANCE = {
    "mlflow.source.git.commit": "commit",
    "git.dirty": "local changes",
    "git.diff": "changes",
    "pipeline.version": "pipeline",
    "pipeline.source_sha256": "pipeline code",  # the pipeline's own code, wherever it ran from
    "pipeline.git.commit": "pipeline commit",  # its clone's, when it runs from one
    "pipeline.git.dirty": "pipeline local changes",
    "pipeline.git.diff": "pipeline changes",
    "torch.version": "torch",
    "torch.cuda": "CUDA",
    "device.type": "device type",
    "device.name": "device name",
}


def bookkeeping(key: str) -> bool:
    return key in BOOKKEEPING or key.startswith(BOOKKEEPING_PREFIXES)


@dataclass(frozen=True)
class Row:
    """One configuration on one code and software: its repeats, in selection order."""

    runs: tuple[ComparedRun, ...]
    label: str = ""  # what tells it from rows of the same config (another commit...): appended to the name

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def name(self) -> str:
        return self.base_name + (f" @{self.label}" if self.label else "")

    @property
    def base_name(self) -> str:
        """The runs' name; where repeats are named apart (a sweep names ``seed1-...``), the parts they share."""
        names = list(dict.fromkeys(r.name for r in self.runs))
        parts = [name.split("-") for name in names]
        columns = list(zip(*parts, strict=False))  # the i-th part of every name, as far as the shortest goes
        if len({len(p) for p in parts}) == 1:
            shared = [c[0] for c in columns if len(set(c)) == 1]
        else:
            shared = [c[0] for c in itertools.takewhile(lambda c: len(set(c)) == 1, columns)]
        return "-".join(shared) or f"{names[0]} (+{len(names) - 1} names)"

    def samples(self, metric: str) -> list[float]:
        return [r.metrics[metric] for r in self.runs if metric in r.metrics and math.isfinite(r.metrics[metric])]

    def stat(self, metric: str) -> Summary | None:
        return summarize(self.samples(metric))

    def speeds(self) -> list[float]:
        """Each run's steady-state samples/s: the whole job's under DDP (``ComparedRun.speed``)."""
        return [s for r in self.runs if (s := r.speed) is not None]

    def speed(self) -> Summary | None:
        return summarize(self.speeds())

    def by_round(self) -> dict[tuple[str, str], float]:
        """samples/s by the sweep and round each run ran in (``ComparedRun.block``), where each has one run."""
        blocks = Counter(r.block for r in self.runs if r.block is not None)
        return {r.block: r.speed for r in self.runs if r.block is not None and blocks[r.block] == 1 and r.speed}

    def step_parts_ms(self) -> dict[str, float] | None:
        """The median over the runs of each part of a steady step, in ms (``STEP_PARTS``); None without them."""
        parts = [p for r in self.runs if (p := r.step_parts_ms()) is not None]
        if not parts:
            return None
        return {name: summarize(p[name] for p in parts).median for name in STEP_PARTS}

    def param(self, key: str) -> str:
        return self.runs[0].params.get(key, "–")  # equal across repeats, by construction

    @property
    def model(self) -> str:
        """The model column: its architecture by name, else its ``_target_``'s last part (``mlp``, ``Tiny``)."""
        params = self.runs[0].params
        if params.get("model.arch"):
            return params["model.arch"]
        if params.get("model._target_"):
            return target_label(params["model._target_"])
        return params.get("model.name", "–")

    def tag(self, key: str) -> str:
        values = Counter(r.tags[key] for r in self.runs if key in r.tags)
        if len(values) <= 1:
            return next(iter(values), "–")
        return " ".join(f"{value}×{count}" for value, count in values.most_common())

    def provenance(self) -> tuple[str | None, ...]:
        return tuple(self.runs[0].tags.get(t) for t in PROVENANCE)  # equal across repeats, by construction

    def peak_mb(self) -> tuple[Summary | None, bool]:
        """The allocator's peak, else the device's (NVML) peak; True when it is the device's."""
        own = self.stat(MEMORY_MAX_ALLOCATED_MB)
        if own is not None:
            return own, False
        device = self.stat(GPU_MEM_PEAK_MB)
        return device, device is not None

    @property
    def oom_events(self) -> int:
        return sum(int(r.metrics.get(OOM_EVENTS, 0)) for r in self.runs)

    @property
    def busy_runs(self) -> int:
        """How many of its runs ran on a busy machine (``ComparedRun.busy``)."""
        return sum(r.busy for r in self.runs)

    @property
    def status(self) -> str:
        counts = Counter(r.status for r in self.runs)
        return "FINISHED" if set(counts) == {"FINISHED"} else ", ".join(f"{c} {s}" for s, c in counts.items())

    @property
    def single_epoch(self) -> bool:
        return any(r.single_epoch for r in self.runs)


def swept(run: ComparedRun) -> frozenset[str]:
    """The keys the run's sweep varied (its ``sweep.keys`` tag) other than the seed: they always define rows, a
    bookkeeping key included (an A/A sweep over ``+tracking.tags.arm=a,b`` is two rows, not one)."""
    return frozenset(k for k in run.tags.get("sweep.keys", "").split(",") if k) - REPEAT_KEYS


def config_params(run: ComparedRun) -> tuple[tuple[str, str], ...]:
    """The params that define what a run measured (no seed, no bookkeeping unless swept), sorted."""
    varied = swept(run)
    return tuple(
        sorted((k, v) for k, v in run.params.items() if k not in REPEAT_KEYS and (k in varied or not bookkeeping(k)))
    )


def config_key(run: ComparedRun) -> tuple[Any, ...]:
    """What makes runs repeats of each other: the config params and the code and software they ran on."""
    return (config_params(run), *(run.tags.get(t) for t in PROVENANCE))


def group(runs: Iterable[ComparedRun]) -> list[Row]:
    """Repeats into rows, in the order each configuration first appears; rows of one config on different code or
    software are labelled with what tells them apart (``@1a2b3c4d+changes``, ``@torch 2.6.0``)."""
    groups: dict[tuple[Any, ...], list[ComparedRun]] = {}
    for run in runs:
        groups.setdefault(config_key(run), []).append(run)
    rows = [Row(tuple(repeats)) for repeats in groups.values()]
    by_config: dict[tuple[Any, ...], list[int]] = {}
    for i, row in enumerate(rows):
        by_config.setdefault(config_params(row.runs[0]), []).append(i)
    for indices in by_config.values():
        if len(indices) > 1:
            for i in indices:
                rows[i] = Row(rows[i].runs, _label(rows[i], [rows[j] for j in indices if j != i]))
    return rows


def _label(row: Row, others: Sequence[Row]) -> str:
    """The provenance that tells ``row`` from ``others`` of the same config, short."""
    mine = row.runs[0].tags
    parts = []
    for tag, name in PROVENANCE.items():
        if all(o.runs[0].tags.get(tag) == mine.get(tag) for o in others):
            continue
        value = mine.get(tag)
        if tag == "mlflow.source.git.commit":
            parts.append((value or "no git")[:8])
        elif tag in ("git.dirty", "git.diff"):  # one word for both: clean, or the local changes' hash
            parts.append(_changes(mine, "git"))
        elif tag == "pipeline.source_sha256":
            parts.append(f"code {(value or '?')[:8]}")
        elif tag.startswith("pipeline.git."):  # its clone: said once, where it is not the launch folder's
            launch = mine.get("mlflow.source.git.commit")
            same = launch == mine.get("pipeline.git.commit") and _changes(mine, "git") == _changes(mine, "pipeline.git")
            if not same:
                commit = (mine.get("pipeline.git.commit") or "no git")[:8]
                parts.append(f"pipeline {commit} {_changes(mine, 'pipeline.git')}")
        else:
            parts.append(f"{name} {value or '?'}")
    return " ".join(dict.fromkeys(parts))


def _changes(tags: Mapping[str, str], prefix: str) -> str:
    """A checkout's local changes in one word: ``clean``, or ``+changes`` and their hash (``<prefix>.dirty/diff``)."""
    diff = tags.get(f"{prefix}.diff")
    return ("+changes" + (f" {diff[:6]}" if diff else "")) if tags.get(f"{prefix}.dirty") == "true" else "clean"


def differences(runs: Sequence[ComparedRun]) -> tuple[list[str], dict[str, str]]:
    """The config keys whose values differ between ``runs`` (a missing key counts as a value), and the keys
    equal in all of them with their value; seed, bookkeeping (unless a sweep varied it) and keys with a column of their
    own are in neither."""
    keys = sorted({k for r in runs for k in r.params} - REPEAT_KEYS - set(SHOWN) - COVERED)
    varied = frozenset().union(*(swept(r) for r in runs))
    diff, same = [], {}
    for key in keys:
        if bookkeeping(key) and key not in varied:
            continue
        values = {r.params.get(key) for r in runs}
        if len(values) > 1:
            diff.append(key)
        else:
            same[key] = next(iter(values))
    return diff, same


def provenance_columns(rows: Sequence[Row]) -> list[str]:
    """The provenance tags whose values differ between rows (each becomes a column)."""
    return [t for t in PROVENANCE if len({row.runs[0].tags.get(t) for row in rows}) > 1]


def only_provenance(rows: Sequence[Row]) -> list[tuple[Row, Row, list[str]]]:
    """Pairs of rows with the same config that differ only in code or software, and in what."""
    by_config: dict[tuple[tuple[str, str], ...], list[Row]] = {}
    for row in rows:  # each row's config once: pairs of 250 rows would compute it 62,000 times
        by_config.setdefault(config_params(row.runs[0]), []).append(row)
    place = {id(row): i for i, row in enumerate(rows)}
    pairs = sorted(
        (pair for same in by_config.values() for pair in itertools.combinations(same, 2)),
        key=lambda pair: (place[id(pair[0])], place[id(pair[1])]),  # in the rows' order, as the pairs of all rows
    )
    return [
        (a, b, [PROVENANCE[t] for t in PROVENANCE if a.runs[0].tags.get(t) != b.runs[0].tags.get(t)]) for a, b in pairs
    ]
