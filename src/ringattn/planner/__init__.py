"""`ringattn plan`'s cost model: memory and step time of a (dp, cp, tp, pp, strategy, layout) plan.

    models.py     model shapes: the trainer's presets, published Llama models, HF config.json
    hardware.py   GPU presets (data sheets) and `cpu` (this machine, measured)
    calibrate.py  the measurement behind `cpu`, cached in a JSON file
    work.py       attention work per rank and ring step, from the layouts' block schedules
    cost.py       step time: compute, exposed communication, pipeline bubble, optimizer
    memory.py     peak memory per rank by kind
    search.py     enumerate the plans of a job, check them, rank them, explain the winner

An application package: the core never imports it. docs/plan.md explains the model and its limits.
"""
