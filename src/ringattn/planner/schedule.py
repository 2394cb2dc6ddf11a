"""Pipeline schedules: how long a step's pipeline stands idle and how many microbatches'
activations the busiest stage keeps.

pp stages, m microbatches, one stage's forward + backward of one microbatch = t (v virtual stages
per rank: each rank holds v chunks of L / (pp v) blocks, a chunk's time is t / v):

    schedule      idle (bubble) per step      activations kept on the first stage
    gpipe         (pp - 1) t                  m microbatches (all forwards before any backward)
    1f1b          (pp - 1) t                  min(m, pp) microbatches
    interleaved   (pp - 1) t / v              min(m, pp) (1 + (pp - 1) / (pp v)) microbatches
                                              (v > 1; v = 1 is 1f1b)

(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sec. 2.2; the interleaved memory factor is Korthikanti et al. 2022, sec. 4.2.3.)
Interleaving sends v times as many activations between stages. Step time = m t + bubble.

`ringattn train` runs gpipe and 1f1b (torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B); its defaults, --pp-schedule gpipe --microbatches 1, are the planner's defaults.
`interleaved` prices published runs (Megatron, torchtitan, Llama 3) that the trainer does not run.
"""

from __future__ import annotations

from ringattn.models.pipeline import SCHEDULES as TRAINER_SCHEDULES

__all__ = ["PP_SCHEDULES", "TRAINER_SCHEDULES", "bubble_slots", "check_schedule", "kept"]

PP_SCHEDULES = (*TRAINER_SCHEDULES, "interleaved")


def check_schedule(
    schedule: str, pp: int, microbatches: int, virtual: int, batch: int, layers: int
) -> None:
    """ValueError (with the fix) for a schedule that cannot run; the trainer's rules for gpipe
    and 1f1b (microbatches divide the batch, 1f1b needs microbatches >= pp)."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"unknown --pp-schedule {schedule!r}; choose one of "
                         f"{', '.join(PP_SCHEDULES)}")  # fmt: skip
    if pp == 1:  # no pipeline: the trainer ignores --microbatches
        return
    if microbatches < 1 or batch % microbatches:
        raise ValueError(f"--microbatches {microbatches} must divide --batch-size {batch} (each "
                         f"dp group's batch is split into microbatches); pick a divisor of "
                         f"{batch}")  # fmt: skip
    if virtual < 1:
        raise ValueError(f"--virtual-stages must be >= 1, got {virtual}")
    if schedule != "gpipe" and microbatches < pp:
        raise ValueError(f"--pp-schedule {schedule} needs --microbatches >= --pp {pp}, got "
                         f"{microbatches}; use more microbatches or gpipe")  # fmt: skip
    if schedule != "interleaved" and virtual != 1:
        raise ValueError(f"--virtual-stages {virtual} needs --pp-schedule interleaved")
    if pp * virtual > layers:
        raise ValueError(f"pp={pp} x {virtual} virtual stages exceed the model's {layers} "
                         "layers; use fewer virtual stages")  # fmt: skip


def bubble_slots(schedule: str, pp: int, virtual: int) -> float:
    """Idle stage-times t per step (see the module docstring)."""
    if pp == 1:
        return 0.0
    return (pp - 1) / (virtual if schedule == "interleaved" else 1)


def kept(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Microbatches whose activations the first stage holds at its peak."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    held = float(min(microbatches, pp))
    if schedule == "interleaved" and virtual > 1:
        held *= 1 + (pp - 1) / (pp * virtual)
    return held
