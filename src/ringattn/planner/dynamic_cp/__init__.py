"""Dynamic CP's placement: which cp group runs each packed document of a step, and its price.

    schedule.py   plan_step (sizes and places, balanced; pure) and static_schedule
    cost.py       DocumentCost(length, size): the planner's quadratic + linear + ring traffic

Shared by `ringattn train --dynamic-cp` (train/dynamic/), `train --hf --dynamic-cp`
(train/hf/dynamic.py) and `ContextParallelConfig(dynamic=True)` (integrations/hf/trainer/
dynamic.py): one scheduler, one cost. docs/dynamic-cp.md explains both.
"""
