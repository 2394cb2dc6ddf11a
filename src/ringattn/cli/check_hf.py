"""`ringattn check --hf DIR_OR_CONFIG`: is this model family exact under context parallelism?

The model is built from the family's config at a tiny width (testing/tiny_hf.py: same
model_type, layer pattern, mixers, experts, vision tower; hidden 64), float32, random weights
from --seed. One packed batch of documents whose total length no 2W divides:

    cp 1 (this process)     reference: each document alone through the plain model (eager
                            attention), loss weighted by its supervised tokens, one backward;
                            and the whole packed sequence (position_ids restarting at 0), which
                            is only reported: a model whose own packed forward mixes documents
                            says so on that line
    cp W (W local ranks,    a copy of the same weights, ringattn.hf.parallelize(layout,
    gloo, or this torchrun  strategy), ringattn.hf.shard_batch of the packed batch, one forward
    world)                  and backward; loss and gradients summed over the ranks

One line per (W, layout, strategy):

    exact    loss within 1e-5 (relative) and every gradient within 1e-4 of its tensor's largest
             reference entry
    refused  every rank raised ValueError/NotImplementedError from ringattn's own code
             (parallelize or the first forward): ringattn says why it cannot run this model
    WRONG    outside those gates (the worst tensor is named)
    CRASH    any other exception (a ValueError raised inside transformers included: that is the
             model failing, not ringattn refusing), or ranks that disagree (each one's error)

Exit 0 when every case is exact or refused, 1 otherwise. The ranks of one world size are
launched once and run every case. Test seam: `fault_rank` (the hidden flag --inject-fault RANK)
puts a forward hook on that rank's output embeddings that scales its logits by 1 + 1e-3, so a
run must end WRONG; tests use it to prove the gates can fail.
"""

from __future__ import annotations

import copy
import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import ringattn
from ringattn.api import STRATEGIES
from ringattn.integrations.hf.source import model_source
from ringattn.layout import LAYOUTS
from ringattn.runtime.launch import LaunchError, init_distributed, launch, running_under_torchrun
from ringattn.testing import tiny_hf

DOCUMENTS = (13, 17, 7)
"""Packed document lengths: 37 tokens, divisible by no 2W for W = 2, 3, 4 (nor 5, 6, 8, 9)."""
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
FAULT = 1e-3
STATUSES = ("exact", "refused", "WRONG", "CRASH")


@dataclass
class HFCheckConfig:
    """What `ringattn check --hf` runs."""

    path: str
    world_sizes: list[int] = field(default_factory=lambda: [2, 3, 4])
    layouts: list[str] = field(default_factory=lambda: ["contiguous", "zigzag", "striped"])
    strategies: list[str] = field(default_factory=lambda: ["ring"])
    seed: int = 0
    timeout_s: float = 120.0
    """Process-group timeout: a rank stuck in a collective fails after this long."""
    fault_rank: int | None = None
    """Test seam (module docstring): this rank's logits are scaled by 1 + 1e-3."""


@dataclass
class Reference:
    """The cp-1 side, computed once and sent to every rank."""

    config: object
    state: dict[str, torch.Tensor]
    loss: float
    grads: dict[str, torch.Tensor]
    whole: tuple[float, float, str]
    """The whole packed sequence vs the documents alone: loss error, grad error, worst tensor."""
    describe: str


def batch(seed: int) -> dict[str, torch.Tensor]:
    """The packed batch (DataCollatorWithFlattening's form): ids avoiding special tokens, label
    -100 at each document's first token, positions restarting at 0."""
    gen = torch.Generator().manual_seed(seed + 1)
    high = tiny_hf.VOCAB - tiny_hf.SPECIAL_IDS
    ids = torch.randint(0, high, (1, sum(DOCUMENTS)), generator=gen, device="cpu")
    labels = ids.clone()
    labels[:, list(itertools.accumulate((0, *DOCUMENTS[:-1])))] = -100
    positions = torch.cat([torch.arange(n, device="cpu") for n in DOCUMENTS]).unsqueeze(0)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}  # fmt: skip


def errors(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> tuple[float, float, str]:
    """(relative loss error, worst gradient error / that tensor's largest entry, its name)."""
    loss_error = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    worst, name = 0.0, ""
    for key, ref in ref_grads.items():
        ratio = (grads[key] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
        if not ratio <= worst:  # NaN counts as worst
            worst, name = ratio, key
    return loss_error, worst, name


def reference(full_config: object, seed: int) -> Reference:
    """Shrink the config, build the model and run the cp-1 side (module docstring)."""
    config = tiny_hf.tiny_config(full_config)
    model = tiny_hf.build(config, seed)
    data = batch(seed)
    bounds = list(itertools.accumulate((0, *DOCUMENTS)))
    total = sum(n - 1 for n in DOCUMENTS)  # supervised tokens: all but each document's first
    loss = 0.0
    for a, b in itertools.pairwise(bounds):
        out = model(input_ids=data["input_ids"][:, a:b], labels=data["labels"][:, a:b],
                    use_cache=False)  # fmt: skip
        (out.loss * ((b - a - 1) / total)).backward()
        loss += out.loss.item() * (b - a - 1) / total
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    whole = model(**data, use_cache=False)
    whole.loss.backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    line = f"{tiny_hf.describe(config)}; {sum(p.numel() for p in model.parameters())} parameters"
    return Reference(config, state, loss, grads, errors(whole.loss.item(), _grads(model), loss,
                                                        grads), line)  # fmt: skip


def load_config(path: str) -> object:
    """The transformers config at --hf PATH (a model directory or a .json file)."""
    from transformers import AutoConfig

    source = model_source(path)
    try:
        return AutoConfig.from_pretrained(source.config_file, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"--hf {path}: cannot read {source.config_file}: {err}") from None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def _fault(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
    """The test seam's forward hook: logits scaled by 1 + FAULT (a shift would leave the
    softmax, and so the loss, unchanged)."""
    return logits * (1 + FAULT)


def _origin(err: BaseException) -> str:
    """'path:line' of the frame that raised `err`."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"


def _raised_by_ringattn(err: BaseException) -> bool:
    """A refusal is ringattn's own ValueError/NotImplementedError: raised in its package. The
    same types raised inside transformers or torch (a model that cannot take this input) are
    crashes, not refusals."""
    package = os.path.dirname(os.path.abspath(ringattn.__file__))
    return os.path.abspath(_origin(err).rpartition(":")[0]).startswith(package + os.sep)


def _run_local(cfg: HFCheckConfig, ref: Reference, base, layout: str, strategy: str):
    """This rank's (status code, note, flat grads + loss or None): 0 ran, 1 refused, 2 crash."""
    import ringattn.hf

    try:
        model = ringattn.hf.parallelize(copy.deepcopy(base), layout=layout, strategy=strategy)
        if cfg.fault_rank == dist.get_rank():
            model.get_output_embeddings().register_forward_hook(_fault)
        out = model(**ringattn.hf.shard_batch(batch(cfg.seed), layout=layout))
        out.loss.backward()
    except (ValueError, NotImplementedError) as err:
        if _raised_by_ringattn(err):
            return 1, _one_line(err), None
        return 2, f"{_one_line(err)} (raised in {_origin(err)}, not by ringattn)", None
    except Exception as err:  # noqa: BLE001 - a crash is a line; the other cases still run
        return 2, _one_line(err), None
    grads = _grads(model)
    flat = torch.cat([*(grads[n].flatten() for n in ref.grads), out.loss.detach().reshape(1)])
    return 0, "", flat


def run_case(cfg: HFCheckConfig, ref: Reference, base, layout: str, strategy: str) -> dict:
    """One case on every rank; every rank returns the same row."""
    code, note, flat = _run_local(cfg, ref, base, layout, strategy)
    world_size = dist.get_world_size()
    outcomes: list = [None] * world_size
    dist.all_gather_object(outcomes, (code, note))
    row = {"cp": world_size, "layout": layout, "strategy": strategy}
    codes = {c for c, _ in outcomes}
    if codes == {1}:
        return {**row, "status": "refused", "note": outcomes[0][1]}
    if codes != {0}:
        failed = [f"rank {r}: {n}" for r, (c, n) in enumerate(outcomes) if c != 0]
        notes = {n for c, n in outcomes if c != 0}
        what = f"every rank: {notes.pop()}" if len(failed) == world_size and len(notes) == 1 else (
            "; ".join(failed))  # fmt: skip
        return {**row, "status": "CRASH", "note": what}
    dist.all_reduce(flat)
    grads, offset = {}, 0
    for name, want in ref.grads.items():
        grads[name] = flat[offset : offset + want.numel()].view_as(want)
        offset += want.numel()
    loss_error, grad_error, name = errors(float(flat[-1]), grads, ref.loss, ref.grads)
    exact = loss_error <= LOSS_RTOL and grad_error <= GRAD_RTOL
    return {**row, "status": "exact" if exact else "WRONG", "loss": loss_error,
            "grads": grad_error, "note": "" if exact else f"worst: {name}"}  # fmt: skip


def format_row(row: dict) -> str:
    head = f"cp {row['cp']:<2} {row['layout']:<10} {row['strategy']:<9} {row['status']:<7}"
    if "loss" in row:
        head += f"  loss {row['loss']:.1e}  grads {row['grads']:.1e}"
    note = row["note"]
    if row["status"] == "refused" and len(note) > 100:
        note = note[:97] + "..."  # the summary prints each reason in full, once
    return head + (f"  {note}" if note else "")


def hf_rank(cfg: HFCheckConfig, ref: Reference | None = None) -> list[dict]:
    """Every case of this world on this rank (ranks launched by run_check_hf, or torchrun)."""
    from transformers.utils import logging

    logging.set_verbosity_error()  # W ranks each warning about a slow CPU path
    init_distributed("gloo", timeout_s=cfg.timeout_s)  # tiny float32 models: CPU, any machine
    ref = reference(load_config(cfg.path), cfg.seed) if ref is None else ref
    base = tiny_hf.build(ref.config, cfg.seed)
    base.load_state_dict(ref.state)
    rows = []
    for layout, strategy in itertools.product(cfg.layouts, cfg.strategies):
        rows.append(run_case(cfg, ref, base, layout, strategy))
        if dist.get_rank() == 0:
            print(format_row(rows[-1]), flush=True)
    dist.barrier()
    return rows


def _header(cfg: HFCheckConfig, ref: Reference) -> None:
    docs = "+".join(map(str, DOCUMENTS))
    print(f"ringattn check --hf {cfg.path}: tiny {ref.describe}", flush=True)
    print(f"batch: {len(DOCUMENTS)} packed documents, {docs} = {sum(DOCUMENTS)} tokens; gates "
          f"(float32): loss {LOSS_RTOL:g} relative, grads {GRAD_RTOL:g} of each tensor's "
          "largest entry", flush=True)  # fmt: skip
    loss, grad, name = ref.whole
    same = loss <= LOSS_RTOL and grad <= GRAD_RTOL
    verdict = "same as" if same else f"MIXES documents (worst: {name}), unlike"
    print(f"cp 1  reference: each document alone, eager; the whole packed sequence: {verdict} "
          f"the documents alone (loss {loss:.1e}, grads {grad:.1e})", flush=True)  # fmt: skip


def _summary(rows: list[dict], crashed: list[int], quiet: bool = False) -> int:
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    bad = counts["WRONG"] + counts["CRASH"] + len(crashed)
    if not quiet:
        for reason in sorted({r["note"] for r in rows if r["status"] == "refused"}):
            print(f"refused: {reason}")
        print(f"{counts['exact']} exact, {counts['refused']} refused, {counts['WRONG']} wrong, "
              f"{counts['CRASH'] + len(crashed)} crashed", flush=True)  # fmt: skip
    return 1 if bad or not rows else 0


def run_check_hf(cfg: HFCheckConfig) -> int:
    """Run every case (launching W local processes per world size); return the exit code."""
    if not cfg.world_sizes or any(w < 1 for w in cfg.world_sizes):
        raise ValueError(f"world sizes must be positive ints, got {cfg.world_sizes}")
    for kind, names, choices in (("layout", cfg.layouts, LAYOUTS),
                                 ("strategy", cfg.strategies, STRATEGIES)):  # fmt: skip
        for name in names:  # a typo must not come back as a case that parallelize "refused"
            if name not in choices:
                raise ValueError(f"unknown {kind} {name!r}; choose from {', '.join(choices)}")
    from transformers.utils import logging

    logging.set_verbosity_error()
    rank0 = os.environ.get("RANK", "0") == "0" or not running_under_torchrun()
    full_config = load_config(cfg.path)  # a bad path or config: ValueError, exit 2
    try:
        ref = reference(full_config, cfg.seed)
    except Exception as err:  # noqa: BLE001 - the family cannot be built or run at all
        print(f"ringattn check --hf {cfg.path}: CRASH at cp 1 (the plain model): "
              f"{_one_line(err)}")  # fmt: skip
        return 1
    if rank0:
        _header(cfg, ref)
    if running_under_torchrun():
        return _summary(hf_rank(cfg, ref), [], quiet=not rank0)
    rows: list[dict] = []
    crashed: list[int] = []
    for world_size in cfg.world_sizes:
        try:
            rows += launch(hf_rank, world_size, cfg, ref)[0]
        except LaunchError as err:
            print(f"cp {world_size:<2} CRASH: the ranks failed:\n{err}", flush=True)
            crashed.append(world_size)
    return _summary(rows, crashed)
