"""`ringattn generate`: greedy decoding from a training checkpoint, on one process.

    checkpoint (sharded by FSDP over W ranks) --DCP, resharded to 1 process--> plain Transformer
    prompt bytes -> repeat: logits of the last position -> argmax -> append

The checkpoint's train_state.json gives the model shape. Without `--prompt`, and when the run
trained on the key-value task, the prompt is a fresh sample of that task (never seen in training)
cut after its last query's key, so the next token is the model's answer, printed with the right
one. There is no KV cache: each new token re-runs the whole prefix (fine for a few tokens).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ringattn.train import checkpoint as ckpt
from ringattn.train.data import KeyValueTask, render
from ringattn.train.model import Transformer, model_config

__all__ = ["GenerateConfig", "generate", "load_model", "run_generate"]


@dataclass
class GenerateConfig:
    """What `ringattn generate` runs; each field is the flag of the same name."""

    checkpoint: str = "runs/demo/checkpoints"
    """A checkpoint directory (step-N) or a directory of them (the newest is used)."""
    prompt: str | None = None
    """Text to continue; default: a fresh sample of the key-value task, if the run used it."""
    max_new_tokens: int = 1
    sample: int = 0
    """Which fresh key-value sample to use as the prompt."""


def _resolve(path: str) -> str:
    newest = ckpt.latest(path)
    if newest is not None:
        return newest
    try:
        ckpt.read_state(path)
    except FileNotFoundError:
        raise ValueError(
            f"{path!r} is neither a checkpoint (step-N with train_state.json) nor a directory "
            f"holding one; train first, e.g. `ringattn demo`, or pass --checkpoint DIR"
        ) from None
    return path


def load_model(path: str) -> tuple[Transformer, dict]:
    """The model of checkpoint `path` on one process (CPU), and its training state."""
    import torch.distributed.checkpoint as dcp

    path = _resolve(path)
    state = ckpt.read_state(path)
    cfg = state["config"]
    model = Transformer(model_config(
        cfg["model"], dim=cfg["dim"], n_layers=cfg["layers"], n_heads=cfg["heads"],
        n_kv_heads=cfg["kv_heads"],
    ))  # fmt: skip
    weights = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(weights, checkpoint_id=path)
    model.load_state_dict(weights["model"])
    return model.eval(), state


@torch.no_grad()
def generate(model: Transformer, tokens: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `tokens` by `max_new_tokens` tokens."""
    out = list(tokens)
    for _ in range(max_new_tokens):
        x = torch.tensor([out])  # (1, S)
        logits = model(x, torch.arange(len(out)))  # (1, S, vocab)
        out.append(int(logits[0, -1].argmax()))
    return out[len(tokens) :]


def run_generate(cfg: GenerateConfig) -> int:
    if cfg.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    model, state = load_model(cfg.checkpoint)
    train_cfg = state["config"]
    print(f"model from {cfg.checkpoint} (step {state['step']}, {train_cfg['model']} size)")
    if cfg.prompt is not None:
        prompt = list(cfg.prompt.encode())
        new = generate(model, prompt, cfg.max_new_tokens)
        print(render(prompt) + "|" + render(new))
        return 0
    if train_cfg["data"] != "key-value":
        raise ValueError(f"the run trained on {train_cfg['data']!r}; pass --prompt TEXT")
    task = KeyValueTask(
        train_cfg["seq_len"], train_cfg["keys"], train_cfg["copies"], train_cfg["noisy"],
        seed=train_cfg["seed"] + 1,  # a different stream from every training sample
    )  # fmt: skip
    inputs, labels = task.sample(cfg.sample)
    answer_at = int((labels >= 0).nonzero()[-1])  # the last query's key
    prompt = inputs[: answer_at + 1].tolist()
    new = generate(model, prompt, cfg.max_new_tokens)
    print(f"prompt: a fresh key-value sample, {len(prompt)} tokens; records of the queried key:")
    key = prompt[-1]
    records = [render([t]) for t in prompt if render([t]).startswith(f"{{{chr(key)}=")]
    print(f"  {' '.join(records)}")
    print(f"prompt ends: ...{render(prompt[-30:])}")
    print(f"generated:   {render(new)}    (right answer: {chr(int(labels[answer_at]))})")
    return 0
