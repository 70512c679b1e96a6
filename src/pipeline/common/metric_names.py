"""Every metric name the package writes to MLflow or reads back from it: ``from pipeline.common.metric_names import
TIME_STEP_MS``.

A metric is found by its spelling: the engine logs ``time/step_ms`` and ``python -m pipeline.compare`` reads it back
from the store, so a name spelled differently on one side is no error, only a column of dashes. Writers and readers
both import the name from here, so the spelling exists once. Names follow ``area/name_unit`` (``_pct``, ``_s``,
``_ms``, ``_mb``); the ``system/`` ones are MLflow's own, so that its UI's System Metrics tab shows them.
Names made of parts at run time (a user's ``task.metrics``, one rank's, one GPU's) are made by the functions at the
end. ``tests/test_metric_names.py`` fails when a name is read that nothing writes, and when a name is spelled out
anywhere else in the package.
"""

from __future__ import annotations

# time/: where a run's time goes. Each epoch (pipeline.engine.hot.timing): the shares of a steady step, its mean time,
# the first step's own (warm-up, compilation), the host-to-device copy of a prefetched run.
TIME_DATA_WAIT_PCT = "time/data_wait_pct"
TIME_H2D_PCT = "time/h2d_pct"
TIME_COMPUTE_PCT = "time/compute_pct"
TIME_OVERHEAD_PCT = "time/overhead_pct"
TIME_FIRST_STEP_S = "time/first_step_s"
TIME_STEP_MS = "time/step_ms"
TIME_H2D_COPY_MS = "time/h2d_copy_ms"  # prefetched runs only
TIME_EPOCH_S = "time/epoch_s"  # wall clock, first step included
TIME_LAUNCH_TO_FIRST_STEP_S = "time/launch_to_first_step_s"  # a fresh run's first epoch: process start to step 1's end
TIME_ALLREDUCE_MS = "time/allreduce_ms"  # DDP: the all-reduce time backward did not hide, at logging points
TIME_DATA_WAIT_PCT_SLOWEST_RANK = "time/data_wait_pct_slowest_rank"  # DDP, rank 0: the rank that waited most
TIME_SLOWEST_RANK = "time/slowest_rank"  # DDP, rank 0: which rank that was
# time/, once at the run's end (pipeline.report.logbook, pipeline.engine.observe.replay).
TIME_TOTAL_S = "time/total_s"
TIME_COMPILE_S = "time/compile_s"  # trainer.compile: what compiling cost beyond as many steady steps
TIME_LOG_MODEL_S = "time/log_model_s"  # tracking.log_model=final
TIME_TRACKING_WRITE_S = "time/tracking_write_s"
TIME_TRACKING_BACKGROUND_WRITE_S = "time/tracking_background_write_s"
TIME_REPLAY_S = "time/replay_s"  # the replay check's cost

# throughput/: steady-state samples/s, each epoch's first step left out.
THROUGHPUT_SAMPLES_PER_S = "throughput/samples_per_s"  # this process's (one rank's under DDP)
THROUGHPUT_GLOBAL_SAMPLES_PER_S = "throughput/global_samples_per_s"  # DDP: every rank's together

# perf/: the arithmetic (pipeline.engine.building.flops), the replay check (pipeline.engine.observe.replay) and the
# profiled GPU (pipeline.engine.observe.profile_report).
PERF_FLOPS_PER_SAMPLE = "perf/flops_per_sample"  # once, at step 0
PERF_TFLOPS = "perf/tflops"
PERF_MFU_PCT = "perf/mfu_pct"  # model FLOPs utilisation: the model's FLOP/s over the device's peak
PERF_REPLAY_SPEEDUP = "perf/replay_speedup"  # the real step time over the step time with free data
PERF_REPLAY_STEP_MS = "perf/replay_step_ms"
PERF_GPU_BUSY_PCT = "perf/gpu_busy_pct"
PERF_GPU_IDLE_HOST_PCT = "perf/gpu_idle_host_pct"
PERF_GPU_IDLE_DATA_PCT = "perf/gpu_idle_data_pct"

# train/: the loop's logging points (trainer.log_every_n_steps) and each epoch's end.
TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"  # when it changed since the last point
TRAIN_GRAD_NORM = "train/grad_norm"  # trainer.clip_grad_*: the norm before clipping
TRAIN_EPOCH_LOSS = "train/epoch_loss"

# val/: evaluation at each epoch's end, per task (pipeline.engine.hot.tasks); task=custom adds ``val_metric(name)``.
VAL_PREFIX = "val/"
VAL_LOSS = "val/loss"  # every task
VAL_ACC = "val/acc"  # classification, next_token
VAL_MAE = "val/mae"  # regression
VAL_RMSE = "val/rmse"  # regression
VAL_F1 = "val/f1"  # multilabel
VAL_EXACT_MATCH = "val/exact_match"  # multilabel
VAL_PERPLEXITY = "val/perplexity"  # next_token

# cpu/ and gpu/: each epoch's utilisation summary (pipeline.monitor.sampler), when the sampler read during it.
CPU_UTIL_MEAN_PCT = "cpu/util_mean_pct"  # the machine's CPUs
CPU_RUN_UTIL_MEAN_PCT = "cpu/run_util_mean_pct"  # the run's processes, over the CPUs it may use
GPU_UTIL_MEAN_PCT = "gpu/util_mean_pct"
GPU_UTIL_P95_PCT = "gpu/util_p95_pct"
GPU_MEM_PEAK_MB = "gpu/mem_peak_mb"  # NVML's reading of the whole device, every process's memory

# memory/: torch's CUDA allocator at each epoch's end (pipeline.monitor.allocator_metrics); CUDA runs only.
MEMORY_MAX_ALLOCATED_MB = "memory/max_allocated_mb"
MEMORY_MAX_RESERVED_MB = "memory/max_reserved_mb"
MEMORY_ALLOC_RETRIES = "memory/alloc_retries"

# oom/: the out-of-memory fallback (pipeline.engine.hot.step), logged only at an event: missing = none.
OOM_EVENTS = "oom/events"  # a running count
OOM_MICRO_BATCH_SIZE = "oom/micro_batch_size"
OOM_MEMORY_MB = "oom/memory_mb"
OOM_EVAL_MICRO_BATCH_SIZE = "oom/eval_micro_batch_size"  # evaluation shrank its own micro-batch

# amp/: mixed precision.
AMP_SKIPPED_STEPS = "amp/skipped_steps"  # float16: steps the GradScaler skipped
AMP_CPU_SPEED_VS_FP32 = "amp/cpu_speed_vs_fp32"  # amp=true on a CPU, timed against float32 at start

# compile/: trainer.compile (pipeline.engine.hot.compilation).
COMPILE_GRAPHS = "compile/graphs"
COMPILE_RECOMPILES = "compile/recompiles"

# profile/: the profiled steps (trainer.profile, or the run's own auto profile).
PROFILE_STEPS = "profile/steps"
PROFILE_STEP_MS = "profile/step_ms"
PROFILE_COST_S = "profile/cost_s"  # the auto profile's cost beyond its steps' own time

# system/: every reading of the utilisation sampler, under MLflow's system-metric names; per GPU: ``system_gpu``.
SYSTEM_CPU_UTILIZATION_PERCENTAGE = "system/cpu_utilization_percentage"
SYSTEM_PROCESS_CPU_UTILIZATION_PERCENTAGE = "system/process_cpu_utilization_percentage"
SYSTEM_MEMORY_USAGE_MEGABYTES = "system/system_memory_usage_megabytes"
SYSTEM_MEMORY_USAGE_PERCENTAGE = "system/system_memory_usage_percentage"

# tune/: the parent run of ``python -m pipeline.tune`` (pipeline.autotune.tuned).
TUNE_PROBE_SAMPLES_PER_S = "tune/probe_samples_per_s"
TUNE_PROBE_MFU_PCT = "tune/probe_mfu_pct"
TUNE_ELAPSED_S = "tune/elapsed_s"
TUNE_TRIALS = "tune/trials"

# autotune/: the run of ``python -m pipeline.autotune`` (pipeline.autotune.report).
AUTOTUNE_ELAPSED_S = "autotune/elapsed_s"
AUTOTUNE_TRIALS = "autotune/trials"
AUTOTUNE_BEST_SAMPLES_PER_S = "autotune/best_samples_per_s"
AUTOTUNE_VS_NEXT_PCT = "autotune/vs_next_pct"
AUTOTUNE_CURRENT_SAMPLES_PER_S = "autotune/current_samples_per_s"
AUTOTUNE_VS_CURRENT_PCT = "autotune/vs_current_pct"
AUTOTUNE_CONFIRMED_VS_CURRENT_PCT = "autotune/confirmed_vs_current_pct"
AUTOTUNE_CONFIRMED_VS_CURRENT_LOW_PCT = "autotune/confirmed_vs_current_low_pct"
AUTOTUNE_CONFIRMED_VS_CURRENT_HIGH_PCT = "autotune/confirmed_vs_current_high_pct"
AUTOTUNE_CONFIRMED_VS_CURRENT_P = "autotune/confirmed_vs_current_p"

# ranks/: DDP, rank 0's record of each rank's epoch, ``rank_metric(rank, RANK_...)``; these are the last part.
RANK_DATA_WAIT_PCT = "data_wait_pct"
RANK_SAMPLES_PER_S = "samples_per_s"
RANK_GPU_UTIL_MEAN_PCT = "gpu_util_mean_pct"  # where the rank's GPU was read

# The areas above: what a metric name starts with (tests/test_metric_names.py finds stray names by them).
AREAS = (
    "time",
    "throughput",
    "perf",
    "train",
    "val",
    "cpu",
    "gpu",
    "memory",
    "oom",
    "amp",
    "compile",
    "profile",
    "system",
    "tune",
    "autotune",
    "ranks",
)


def val_metric(name: str) -> str:
    """``val/<name>``: a validation metric by its name in ``task.metrics`` (task=custom), which the user chooses."""
    return VAL_PREFIX + name


def rank_metric(rank: int, name: str) -> str:
    """``ranks/<rank>/<name>``: one rank's figure of an epoch under DDP; the rank varies, and the name is one of
    ``RANK_DATA_WAIT_PCT``, ``RANK_SAMPLES_PER_S``, ``RANK_GPU_UTIL_MEAN_PCT``."""
    return f"ranks/{rank}/{name}"


def system_gpu(index: int, reading: str) -> str:
    """``system/gpu_<index>_<reading>``: one GPU's reading under MLflow's name for it; the GPU's index varies, and the
    reading is ``utilization_percentage``, ``memory_usage_megabytes``, ``memory_usage_percentage``,
    ``temperature_celsius``, ``power_usage_watts`` or ``power_usage_percentage``."""
    return f"system/gpu_{index}_{reading}"
