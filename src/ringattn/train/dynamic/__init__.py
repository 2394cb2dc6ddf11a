"""Dynamic context parallelism (`ringattn train --data docs:... --dynamic-cp`): per step, each
packed document gets a group of 1, 2, 4, ... cp ranks, placed over dp x cp by planned cost.

    planner/dynamic_cp/documents.py --data docs:MEAN,SIGMA,MIN,MAX: windows packed with
                                    lognormal-length documents (the planner draws them too)
    planner/dynamic_cp/cost.py      DocumentCost(length, size): the planner's quadratic +
                                    linear + ring traffic
    planner/dynamic_cp/schedule.py  plan_step: sizes and places, balanced (pure;
                                    static_schedule for static CP)
    runtime/subgroups.py            the sub-groups of every cp row, created once at start-up
    loader.py                       DocumentLoader.batch(step): this rank's pieces as
                                    models/segments.py Segments

Exact by construction: the windows are static CP's, each supervised token is computed on one
rank once, the loss is divided by the global batch's supervised count (train/step.py) and FSDP
sums the gradients over every rank; only where each document is computed changes.
The scheduler, its cost and the groups live outside train/ so that the planner (`plan
--lengths`) and the Trainer integration (integrations/hf/trainer/dynamic.py) use the same ones.
docs/dynamic-cp.md has the whole story.
"""
