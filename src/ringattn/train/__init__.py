"""The trainer: a Llama-style decoder (or a Hugging Face model) trained over a pp x dp x cp x tp
mesh (TP/SP, pipeline stages, FSDP2, DCP checkpoints that reshard), the demo, generation.

    ringattn train / demo (cli/main.py)
      flags.py   flags -> TrainConfig                     config.py: fields, validate()
      main.py    run_train: validate, launch W ranks (runtime/launch.py) or join torchrun's world
                   rank: train_worker -> init_distributed
      run.py       build_run(cfg, device, recipe) -> Run, built ONCE:
                     mesh.py    Mesh (pp, dp, cp, tp), parallelize (TP, PP, CP, FSDP2)
                     model.py   plain single-device decoder (recipe.build)
                     step.py    AdamW
                     checkpoint.py  resume: newest complete checkpoint
                     data.py    Loader: step -> this rank's Batch (ringattn.shard / positions)
      loop.py      train(run): for each step, step.py's train_step; log, progress, run.save
                   -> run.summary() back to the parent

Each module holds one idea and reads only what it is given: the config is read by `build_run`
(and by the loop for its schedule), never handed down through the model, the data or the mesh.
"""
