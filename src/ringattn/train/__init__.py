"""The trainer: a Llama-style decoder trained over a dp x cp mesh (FSDP2, DCP checkpoints), the
demo, generation.

    ringattn train / demo (cli/main.py)
      flags.py   flags -> TrainConfig                     config.py: fields, validate()
      main.py    run_train: validate, launch W ranks (runtime/launch.py) or join torchrun's world
                   rank: train_worker -> init_distributed
      run.py       build_run(cfg, device, recipe) -> Run, built ONCE:
                     mesh.py    Mesh (dp, cp), parallelize (CP attention, FSDP2)
                     model.py   plain single-device decoder (recipe.build)
                     step.py    AdamW
                     checkpoint.py  resume: newest complete checkpoint
                     data.py    Loader: step -> this rank's Batch (ringattn.shard / positions)
      loop.py      train(run): for each step, step.py's train_step; log, progress, run.save
                   -> run.summary() back to the parent

Each module holds one idea and reads only what it is given: the config is read by `build_run`
(and by the loop for its schedule), never handed down through the model, the data or the mesh.
"""
