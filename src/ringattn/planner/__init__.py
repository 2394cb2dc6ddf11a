"""`ringattn plan`'s cost model: memory and step time of a (dp, cp, tp, pp, strategy, layout) plan.

    models.py     model shapes: the trainer's presets, published Llama models, HF config.json
    hardware.py   GPU presets (data sheets, peaks per dtype) and `cpu` (this machine, measured)
    kernels.py    attention kernel rates per kernel, mask, direction, dtype: published curves
    calibrate.py  the measurement behind `cpu`, cached in a JSON file
    oversubscribe.py  the measured cost of more local processes than cores
    work.py       attention work per rank and ring step, from the layouts' block schedules
    schedule.py   pipeline schedules (gpipe, 1f1b, interleaved): bubble, activations kept
    cost.py       step time: compute, exposed communication, pipeline bubble, optimizer
    memory.py     peak memory per rank by kind
    search.py     enumerate the plans of a job, check them, rank them, explain the winner
    command.py    the `ringattn train` command line of a plan
    published.py  published runs next to the predictions (the regression checks)

An application package: the core never imports it. docs/plan.md explains the model and its limits.
"""
