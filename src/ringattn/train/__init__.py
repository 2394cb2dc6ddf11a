"""The trainer: a Llama-style decoder (models/) or a Hugging Face model (hf/) trained over a
pp x dp x cp x tp mesh (TP/SP, pipeline stages, FSDP2, DCP checkpoints that reshard), the demo.

    ringattn train / demo (cli/train.py: flags -> TrainConfig)
      config.py  TrainConfig fields, validate(cfg, W, recipe.check)
      main.py    run_train: validate, launch W ranks (runtime/launch.py) or join torchrun's world
                   rank: train_worker -> init_distributed
      run.py       build_run(cfg, device, recipe_for(cfg)) -> Run, built ONCE:
                     recipe.py   ModelRecipe(build, parallelize, loader, check)
                     decoder.py  DECODER: models/decoder.py + models/parallelize.py
                     hf/         HF: a transformers causal LM, its packed documents, the export
                     runtime/mesh.py, runtime/checkpoint/: the mesh; resume
                     step.py    AdamW
                     data.py    Loader: step -> this rank's Batch (ringattn.shard / positions)
                     dynamic/   --data docs: packed documents, static or --dynamic-cp
                                (per-step group sizes, sub-groups made once): DocumentLoader
      loop.py      train(run): for each step, step.py's train_step; log, progress, run.save
                   -> run.summary() back to the parent

Each module holds one idea and reads only what it is given: the config is read by `build_run`
(and by the loop for its schedule), never handed down through the model, the data or the mesh.
"""
