"""One module names the metrics (``pipeline.common.metric_names``): every name read is written, the names a run logs are
the module's, and no other module of the package spells a metric name out.

Writers and readers are told apart by where a name's constant stands in the source: a key of a dict display, the key
of a subscript assignment (``metrics[NAME] = value``) or an argument of a ``log_metric``/``log_metrics`` call writes
it; any other use (``metrics.get(NAME)``, a tuple of names a table shows, a default) reads it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from mlflow import MlflowClient

import pipeline
from pipeline.common import metric_names
from pipeline.common.metric_names import (
    AMP_SKIPPED_STEPS,
    AREAS,
    GPU_MEM_PEAK_MB,
    GPU_UTIL_MEAN_PCT,
    MEMORY_MAX_ALLOCATED_MB,
    OOM_EVENTS,
    PERF_GPU_BUSY_PCT,
    PERF_GPU_IDLE_DATA_PCT,
    PERF_GPU_IDLE_HOST_PCT,
    PROFILE_STEPS,
    THROUGHPUT_GLOBAL_SAMPLES_PER_S,
    TIME_DATA_WAIT_PCT_SLOWEST_RANK,
    TRAIN_GRAD_NORM,
    VAL_EXACT_MATCH,
    VAL_F1,
    VAL_MAE,
    VAL_PERPLEXITY,
    VAL_RMSE,
    rank_metric,
    system_gpu,
    val_metric,
)
from pipeline.config import RunConfig
from pipeline.train import train

PACKAGE = Path(pipeline.__file__).parent
NAMES_MODULE = Path(metric_names.__file__)
WRITE_CALLS = frozenset({"log_metric", "log_metrics"})
# A string that is a metric name: an area of the module, a slash, then lower-case words (no dot: artifact paths such
# as profile/trace.json.gz are files, not metrics).
LOOKS_LIKE_A_NAME = re.compile(rf"(?:{'|'.join(AREAS)})/[a-z0-9_]*(?:/[a-z0-9_]*)*")

# Names read somewhere that the tiny CPU run of ``test_a_tiny_run_logs_every_name_that_is_read`` does not log, each
# with the condition under which it is written.
CONDITIONAL = {
    VAL_MAE: "task=regression",
    VAL_RMSE: "task=regression",
    VAL_F1: "task=multilabel",
    VAL_EXACT_MATCH: "task=multilabel",
    VAL_PERPLEXITY: "task=next_token",
    THROUGHPUT_GLOBAL_SAMPLES_PER_S: "DDP: rank 0, with more than one rank",
    TIME_DATA_WAIT_PCT_SLOWEST_RANK: "DDP: rank 0, with more than one rank",
    GPU_UTIL_MEAN_PCT: "a GPU, read by the sampler during the epoch",
    GPU_MEM_PEAK_MB: "a GPU, read by the sampler during the epoch",
    MEMORY_MAX_ALLOCATED_MB: "a CUDA device",
    OOM_EVENTS: "an out-of-memory error the fallback recovered from",
    AMP_SKIPPED_STEPS: "amp with float16 (the GradScaler)",
    TRAIN_GRAD_NORM: "trainer.clip_grad_*",
    PROFILE_STEPS: "steps profiled: trainer.profile=true, or the auto profile on a run whose MFU is low",
    PERF_GPU_BUSY_PCT: "steps profiled on a CUDA device",
    PERF_GPU_IDLE_HOST_PCT: "steps profiled on a CUDA device",
    PERF_GPU_IDLE_DATA_PCT: "steps profiled on a CUDA device",
}


def names_by_constant() -> dict[str, str]:
    """The module's metric names by their constant's name (prefixes and the ``ranks/`` parts left out)."""
    return {
        key: value
        for key, value in vars(metric_names).items()
        if key.isupper() and isinstance(value, str) and "/" in value and not value.endswith("/")
    }


def package_modules() -> Iterator[Path]:
    """Every module of the package but the names module and those being moved out."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != NAMES_MODULE:
            yield path


def _imported_names(tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """What a module calls the names module's constants (``from ... import X as Y``: Y -> X) and the module itself."""
    constants, modules = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == metric_names.__name__:
            constants.update({alias.asname or alias.name: alias.name for alias in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module == "pipeline.common":
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == "metric_names"}
    return constants, modules


def _writes(node: ast.AST, parent: ast.AST) -> bool:
    """Whether this use of a name writes it: a dict display's key, a subscript assigned to, a log call's argument."""
    if isinstance(parent, ast.Dict):
        return any(key is node for key in parent.keys)
    if isinstance(parent, ast.Subscript):
        return parent.slice is node and isinstance(parent.ctx, ast.Store)
    if isinstance(parent, ast.Call):
        called = parent.func.attr if isinstance(parent.func, ast.Attribute) else getattr(parent.func, "id", "")
        return called in WRITE_CALLS and any(arg is node for arg in parent.args)
    return False


def uses(tree: ast.Module) -> Iterator[tuple[str, bool, int]]:
    """Each use of a constant of the names module in ``tree``: the constant, whether it writes, the line."""
    constants, modules = _imported_names(tree)
    for parent in ast.walk(tree):
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, ast.Name) and node.id in constants:
                yield constants[node.id], _writes(node, parent), node.lineno
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in modules:
                yield node.attr, _writes(node, parent), node.lineno


def writers_and_readers() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Where each metric name's constant is written and where it is read, as ``path:line``."""
    names = names_by_constant()
    written: dict[str, list[str]] = defaultdict(list)
    read: dict[str, list[str]] = defaultdict(list)
    for path in package_modules():
        for constant, writes, line in uses(ast.parse(path.read_text(), str(path))):
            if constant not in names:
                continue  # VAL_PREFIX, the ranks/ parts, AREAS, the functions
            (written if writes else read)[constant].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return written, read


def test_every_metric_name_that_is_read_is_written_somewhere() -> None:
    written, read = writers_and_readers()
    unwritten = {name: where for name, where in read.items() if name not in written}
    assert not unwritten, f"read, but written nowhere in src/pipeline: {unwritten}"


def test_every_name_of_the_module_is_written_somewhere() -> None:
    written, _ = writers_and_readers()
    assert sorted(set(names_by_constant()) - set(written)) == []


def test_the_readers_are_found() -> None:
    """The scan sees the comparison's and the summary's reads, so an empty result above is no blind spot."""
    _, read = writers_and_readers()
    assert any(where.startswith("pipeline/experiments/compare/runs.py:") for where in read["TIME_STEP_MS"])
    assert any(where.startswith("pipeline/report/summary.py:") for where in read["VAL_ACC"])
    assert any(where.startswith("pipeline/engine/checkpointing/start.py:") for where in read["TRAIN_LOSS"])


def test_no_two_constants_share_a_spelling_and_each_is_in_an_area() -> None:
    names = names_by_constant()
    assert len(set(names.values())) == len(names)
    assert [n for n in names.values() if not LOOKS_LIKE_A_NAME.fullmatch(n)] == []


def test_names_made_of_parts_are_spelled_as_the_record_holds_them() -> None:
    assert val_metric("top5") == "val/top5"
    assert rank_metric(1, metric_names.RANK_SAMPLES_PER_S) == "ranks/1/samples_per_s"
    assert system_gpu(0, "utilization_percentage") == "system/gpu_0_utilization_percentage"


def _docstrings(tree: ast.Module) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
    }


def _a_literal_name(node: ast.AST, skipped: set[int]) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skipped
        and LOOKS_LIKE_A_NAME.fullmatch(node.value) is not None
    )


def stray_names(source: str, where: str) -> list[str]:
    """The string literals of ``source`` (docstrings aside) that are, or begin an f-string with, a metric name."""
    tree = ast.parse(source)
    skipped = _docstrings(tree)  # and the parts of f-strings, read as the f-string's head below
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skipped |= {id(part) for part in node.values}
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and LOOKS_LIKE_A_NAME.fullmatch(head.value):
                found.append((node.lineno, f"{where}:{node.lineno}: f{head.value!r}..."))
        elif _a_literal_name(node, skipped):
            found.append((node.lineno, f"{where}:{node.lineno}: {node.value!r}"))
    return [hit for _, hit in sorted(found)]


def test_no_other_module_of_the_package_spells_a_metric_name_out() -> None:
    found = [hit for path in package_modules() for hit in stray_names(path.read_text(), path.name)]
    assert found == []


def test_the_stray_name_check_finds_literals_and_f_strings_but_not_files_or_prose() -> None:
    source = '"""About time/step_ms."""\na = {"time/step_ms": 1}\nb = f"val/{n}"\nc = "profile/trace.json.gz"\n'
    source += 'd = "samples/s"\ne = "epoch %d: train/loss %.4f"\n'
    assert stray_names(source, "m.py") == ["m.py:2: 'time/step_ms'", "m.py:3: f'val/'..."]


def test_a_tiny_run_logs_every_name_that_is_read_and_only_names_of_the_module(
    make_cfg: Callable[..., RunConfig], store_uri: str
) -> None:
    result = train(make_cfg("trainer.log_every_n_steps=1"), echo=False)
    logged = set(MlflowClient(store_uri).get_run(result.run_id).data.metrics)
    names = names_by_constant()
    assert logged - set(names.values()) == set()  # a name logged that the module lacks
    _, read = writers_and_readers()
    missing = {names[c] for c in read} - logged
    assert {name: CONDITIONAL.get(name) for name in missing if name not in CONDITIONAL} == {}
    assert set(CONDITIONAL) <= set(names.values())
