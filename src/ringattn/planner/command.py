"""The `ringattn train` command line that runs a plan, and what in the plan it cannot run.

    cpu:   ringattn train --nproc N ...        (one machine; cpu hosts of G processes: torchrun)
    GPUs:  torchrun --nnodes=K --nproc-per-node=G -m ringattn train ...   (K nodes of G GPUs;
                                                   add torchrun's rendezvous flags for K > 1)

The flags are the trainer's own (cli `ringattn train --help`): the degrees, strategy, layout (and
hybrid's --ulysses), --seq-len, --batch-size, --dtype, --activation-checkpointing and, with
pp > 1, --pp-schedule and --microbatches, always written out, so the run does not depend on the
trainer's defaults. The model: a trainer preset by name (--model), a Hugging Face config by its
path (--hf PATH --data text:DATA, DATA being your text), a published shape by the path its
config.json would have (NAME/config.json).

Hybrid models get --mixer-scheme, the scheme priced (state, heads or whole). Some plans price
what the trainer does not run; the note says which: fp8 and TF32 matmuls, fp8 attention, the
interleaved schedule, and a kernel other than the one `auto` picks (the trainer has no kernel
flag: it runs backend auto).
"""

from __future__ import annotations

import shlex

from ringattn.planner.cost import PlanSpec
from ringattn.planner.kernels import default_kernel
from ringattn.planner.schedule import TRAINER_SCHEDULES
from ringattn.planner.work import LIBRARY_NAMES

__all__ = ["train_command"]

TRAINER_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _model_flags(spec: PlanSpec) -> list[str]:
    m = spec.model
    if m.source == "trainer":
        return ["--model", m.name]
    path = m.source or f"{m.name}/config.json"
    return ["--hf", path, "--data", "text:DATA"]


def train_command(spec: PlanSpec) -> tuple[str, str | None]:
    """(the command line, a note on what of the plan it does not run or None)."""
    hw, notes = spec.hw, []
    if hw.is_cpu and spec.gpus <= hw.gpus_per_node:  # one machine (cpu hosts: torchrun below)
        launch = ["ringattn", "train", "--nproc", str(spec.gpus)]
    else:
        per_node = min(spec.gpus, hw.gpus_per_node)
        nodes = -(-spec.gpus // per_node)
        launch = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "-m",
                  "ringattn", "train"]  # fmt: skip
    flags = [*_model_flags(spec), "--dp", str(spec.dp), "--cp", str(spec.cp),
             "--tp", str(spec.tp), "--pp", str(spec.pp), "--strategy", spec.strategy,
             "--layout", spec.layout]  # fmt: skip
    if spec.strategy == "hybrid":
        flags += ["--ulysses", str(spec.ulysses)]
    if spec.ep > 1:
        flags += ["--ep", str(spec.ep)]
    flags += ["--seq-len", str(spec.seq_len), "--batch-size", str(spec.batch_size)]
    flags += ["--dtype", TRAINER_DTYPES.get(spec.dtype, "bfloat16")]
    if spec.dtype not in TRAINER_DTYPES:
        notes.append(f"{spec.dtype} matmuls: the trainer runs bfloat16 or float32")
    run = spec.mixer_run
    if spec.model.mixer_layers and spec.cp > 1:  # at cp 1 every scheme is the same
        flags += ["--mixer-scheme", LIBRARY_NAMES[run]]
    if spec.fp8_attention:
        notes.append("fp8 attention: the trainer's attention is bf16")
    if spec.activation_checkpointing:
        flags.append("--activation-checkpointing")
    if spec.tiled_mlp:
        flags += ["--tiled-mlp", str(spec.tiled_mlp)]
    if spec.offload_activations and spec.activation_checkpointing:
        flags.append("--offload-activations")
    if spec.offload_states:
        notes.append("model-state offload: a what-if the trainer does not run (weights and "
                     "optimizer states in host memory, as DeepSpeed's ZeRO-3 offload)")  # fmt: skip
    if spec.pp > 1:
        schedule = spec.pp_schedule if spec.pp_schedule in TRAINER_SCHEDULES else "1f1b"
        flags += ["--pp-schedule", schedule, "--microbatches", str(spec.microbatches)]
        if spec.pp_schedule not in TRAINER_SCHEDULES:
            notes.append(f"{spec.pp_schedule} pipeline schedule: the trainer runs "
                         f"{' or '.join(TRAINER_SCHEDULES)} (1f1b shown)")  # fmt: skip
    if not hw.is_cpu and spec.kernel != default_kernel(hw.arch, spec.dtype):
        notes.append(f"attention kernel {spec.kernel}: the trainer runs backend auto "
                     f"({default_kernel(hw.arch, spec.dtype)} here)")  # fmt: skip
    return shlex.join(launch + flags), "; ".join(notes) or None
