"""Dynamic CP's placement: which cp group runs each packed document of a step, and its price.

    schedule.py   plan_step (sizes and places, balanced; pure) and static_schedule
    cost.py       DocumentCost(length, size): the planner's quadratic + linear + ring traffic
    documents.py  lognormal document lengths packed into windows (`--data docs:...`)
    lengths.py    `plan --lengths`: a distribution or a file of lengths
    pieces.py     a step's pieces priced as the ring runs them (kernel calls, hops, fixed terms)
    ringstep.py   the fixed terms measured (`python -m ringattn.planner.dynamic_cp.ringstep`)
    predict.py    static and dynamic step times side by side (`plan --lengths`)

Shared by `ringattn train --dynamic-cp` (train/dynamic/), `train --hf --dynamic-cp`
(train/hf/dynamic.py) and `ContextParallelConfig(dynamic=True)` (integrations/hf/trainer/
dynamic.py): one scheduler, one cost. docs/dynamic-cp.md explains both.
"""
