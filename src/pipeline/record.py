"""What a run writes to its record besides metrics: at the start its config, data and environment (or, resumed,
what changed); at the end its verdict, pictures, last figures and the ``RunResult``.

In a DDP job only rank 0 records its start; every rank concludes (the other ranks' trackers record nothing).
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from pipeline import doctor
from pipeline.build import Setup
from pipeline.config import flatten
from pipeline.memory import batchnorm_note
from pipeline.plots import step_breakdown, utilisation_timeline
from pipeline.provenance import describe_loader, environment_tags
from pipeline.resume import Resumed
from pipeline.summary import EpochRecord, RunResult
from pipeline.timing import combine
from pipeline.tracking import Tracker
from pipeline.verdict import judge


def start(tracker: Tracker, setup: Setup, recorded: dict[str, Any], typed: list[str], resumed: Resumed | None) -> None:
    """What a run records before training: its config, data and environment; or, resumed, what changed."""
    probe = setup.amp_probe
    if probe is not None:
        tracker.set_tags({"amp.cpu_speed_vs_fp32": f"{probe.speed:.2f} (batch {probe.batch}, measured at start)"})
        tracker.log_metrics({"amp/cpu_speed_vs_fp32": probe.speed}, step=0)
    if resumed is not None:
        tracker.set_tags(resumed.tags(typed, logged_step=tracker.last_step("train/loss")))
        if not resumed.fork:
            return  # the same run: its params are fixed, and the tags describe the resumed part
    tracker.log_params({**flatten(recorded), **setup.group.record(setup.cfg.loader.batch_size)})
    tracker.log_dataset(setup.spec, context="train")
    tracker.log_text(yaml.safe_dump(recorded, sort_keys=False), "config.yaml")
    tracker.log_text("\n".join(typed) + "\n", "overrides.txt")
    environment = doctor.report(smoke=False)  # the doctor's findings, kept with the run
    tracker.log_text(json.dumps(environment, indent=2), "environment.json")
    tracker.set_tags(environment_tags(environment, setup.device))


def conclude(
    setup: Setup,
    epochs: list[EpochRecord],
    *,
    tracker: Tracker,
    sampler: Any,
    epoch_starts: list[float],
    total_s: float,
) -> RunResult:
    """The run's verdict, pictures and record, once the sampler has stopped."""
    breakdown = combine([e.breakdown for e in epochs])
    utilisation = sampler.summary()
    verdict = judge(
        setup.cfg,
        device_type=setup.device.type,
        data_wait_pct=max([breakdown.data_wait_pct] + [e.slowest_rank_wait_pct for e in epochs]),
        h2d_pct=breakdown.h2d_pct,
        overhead_pct=breakdown.overhead_pct,
        gpu_util_pct=utilisation.gpu_util_mean_pct,
        precision=setup.policy.label,
    )
    tags = {"bottleneck": verdict.bottleneck, "bottleneck.hint": verdict.message}
    note = batchnorm_note(setup.state.model, setup.state.micro)
    if note:
        tags["oom.batchnorm"] = note
    tracker.set_tags(tags)
    if setup.cfg.monitor.plots:
        title = setup.run_name
        tracker.log_figure(
            lambda: utilisation_timeline(sampler.samples, epoch_starts, title=title), "plots/utilisation.png"
        )
        tracker.log_figure(lambda: step_breakdown([e.breakdown for e in epochs], title=title), "plots/step_time.png")
    tracker.log_metrics(
        {
            "time/total_s": total_s,
            "time/tracking_write_s": tracker.write_s,
            "time/tracking_background_write_s": tracker.background_write_s,
        },
        step=len(epochs),
    )
    return RunResult(
        run_name=setup.run_name,
        run_id=tracker.run_id,
        device=str(setup.device),
        device_name=setup.choice.name,
        precision=setup.policy.label,
        loader=describe_loader(setup.cfg),
        parameters=setup.parameters,
        steps=setup.state.step,
        total_s=total_s,
        epochs=epochs,
        breakdown=breakdown,
        utilisation=utilisation,
        tracking_write_s=tracker.write_s,
        tracking_background_write_s=tracker.background_write_s,
        oom_events=list(setup.state.micro.events),
        micro_batch=setup.state.micro.micro_batch,
        eval_micro_batch=setup.eval_micro.micro_batch,
        bottleneck=verdict.bottleneck,
        verdict=verdict.message,
        tracking=tracker.describe(),
        model=setup.state.model,
        amp_probe=setup.amp_probe,
        notes=[note] if note else [],
        distributed=setup.group.describe(setup.cfg.loader.batch_size),
    )
