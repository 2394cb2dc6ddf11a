"""Family survey: is every causal-LM family transformers registers exact under ringattn.hf at cp 2?

    PYTHONPATH=src python scripts/tools/family_survey.py                   # every family (~minutes)
    PYTHONPATH=src python scripts/tools/family_survey.py --families llama opt

For each model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: a tiny config (the config class's
defaults through ringattn.testing.tiny_hf, the shrinker `ringattn check --hf` uses, with the
family's SETTINGS below), seeded random float32 weights (constant tensors such as norms get noise
too, so they matter), then four cases at cp 2 (gloo): layouts zigzag and contiguous x a dense
one-document batch and a packed batch (documents 11, 1, 18, 7 by position_ids restarting at 0).
The reference is the same model in one process with eager attention: the whole sequence (dense),
or each document run alone, its loss sum taken over the whole batch's supervised-token count
(packed). The gates are those of
tests/workers_hf.py: loss relative error <= 1e-5; every gradient's max error <= 1e-4 x that
tensor's max |entry| (the CP side's loss and gradients summed over the ranks).

    parent: launch(worker, 2, families)  -->  rank 0 / rank 1, one family at a time:
        results.jsonl  <-- rank 0 appends     build, reference, 4 CP cases on a fresh gloo group
        a launch that dies: its family is     (timeout 30 s), alarm after --time-limit s,
        marked crashed, the rest relaunch     outcome gathered on the world group

Verdicts: exact (all four cases pass), wrong (a case's numbers are off), crashed (an exception
outside ringattn's own checks, a timeout), refused (ringattn raised ValueError or
NotImplementedError), build-failed (the tiny model did not build or its reference did not run).
A family's verdict is its worst case's in that order; every case is in the JSON.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import signal
import sys
import time
import traceback

import torch

# ruff: noqa: BLE001 - a survey: any family's exception is a result to record, not a bug here

DOCS = (11, 1, 18, 7)  # a one-token document, and one longer than every sliding window
SEQ_LEN = sum(DOCS)
LAYOUTS = ("zigzag", "contiguous")
KINDS = ("dense", "packed")
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
# A gradient that is zero analytically (a key projection's bias: softmax ignores a constant per
# row) is rounding noise in both runs; below this fraction of the model's largest gradient entry,
# a tensor is judged against that fraction instead of its own max.
ZERO_GRAD = 1e-3
GROUP_TIMEOUT_S = 30

# A family's own settings, set on its tiny config before it is rebuilt: where its default config
# is no working model (dots1 has no experts, nemotron no kv heads, cohere_compass_text no RoPE for
# its layer type, DBRX's attn_config no rope_theta), and where the survey wants a feature to
# matter at the tiny scale (attention softcapping at 0.3: at 50 it would not change a score)
SETTINGS: dict[str, dict] = {
    "big_bird": {"attention_type": "original_full"},  # block-sparse needs long sequences
    "reformer": {
        "is_decoder": True,
        "axial_pos_embds_dim": [32, 32],
        "axial_pos_shape": [8, 16],
        "attn_layers": ["local", "lsh"],
    },
    "nemotron": {"num_key_value_heads": 2},
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "attn_pdrop": 0.0, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "gemma2": {"attn_logit_softcapping": 0.3},
    "granitemoeshared": {"shared_intermediate_size": 32},  # its default 0 builds no shared MLP
    "vaultgemma": {"attn_logit_softcapping": 0.3},
    "dots1": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
}


def tiny_config(model_type: str):
    """The family's default config through ringattn.testing.tiny_hf, with its SETTINGS."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ringattn.testing import tiny_hf

    defaults = CONFIG_MAPPING[model_type]()  # defaults that do not validate: build-failed
    settings = SETTINGS.get(model_type, {})
    config = tiny_hf.tiny_config(defaults, settings)
    nope, rope = (getattr(config, n, None) for n in ("qk_nope_head_dim", "qk_rope_head_dim"))
    mla = isinstance(nope, int) and isinstance(rope, int)
    qk = nope + rope if mla else getattr(config, "head_dim", None)
    v = getattr(config, "v_head_dim", None)
    if isinstance(qk, int) and isinstance(v, int) and v != qk:
        # ringattn.hf takes k and v of one width and refuses unequal ones (DeepSeek-V3's MLA:
        # 192 vs 128) with a ValueError; the survey checks the rest of the family at v = qk
        config = tiny_hf.tiny_config(defaults, {**settings, "v_head_dim": qk})
    return config


def build(model_type: str, **overrides: object) -> torch.nn.Module:
    """The tiny model, seeded; `overrides` set config fields first (tests' variants)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    model.train()
    with torch.no_grad():  # constant tensors (norms, biases, sinks) get noise, so they matter
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _special_ids(config) -> set[int]:
    ids = set()
    for c in [config, *(getattr(config, k) for k in config.sub_configs)]:
        for key, value in (c.to_dict() if hasattr(c, "to_dict") else {}).items():
            if "token" in key or key.endswith(("_id", "_index")):
                values = value if isinstance(value, list) else [value]
                ids |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
    return ids


def data(model, kind: str) -> dict[str, torch.Tensor]:
    """The full batch: ids that are no special token; packed: positions restart per document."""
    allowed = torch.tensor([i for i in range(3, 100) if i not in _special_ids(model.config)])
    gen = torch.Generator().manual_seed(1)
    ids = allowed[torch.randint(0, len(allowed), (1, SEQ_LEN), generator=gen)]
    labels = ids.clone()
    if kind == "dense":
        labels[:, :3] = -100
        return {"input_ids": ids, "labels": labels}
    starts = list(itertools.accumulate(DOCS, initial=0))[:-1]
    labels[:, starts] = -100
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}  # fmt: skip


def reference(model, kind: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, eager: the whole sequence, or each packed document alone."""
    batch = data(model, kind)
    model.zero_grad(set_to_none=True)
    if kind == "dense":
        loss = model(**batch, use_cache=False).loss
    else:
        total = sum(n - 1 for n in DOCS)
        loss = 0.0
        for start, n in zip(itertools.accumulate(DOCS, initial=0), DOCS):
            if n < 2:
                continue
            ids = batch["input_ids"][:, start : start + n]
            labels = ids.clone()
            labels[:, 0] = -100
            loss = loss + model(input_ids=ids, labels=labels, use_cache=False).loss * (n - 1)
        loss = loss / total
    loss.backward()
    return loss.item(), _grads(model)


def cp_case(model, kind: str, layout: str, group) -> tuple[float, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    import ringattn.hf

    model.zero_grad(set_to_none=True)
    batch = ringattn.hf.shard_batch(data(model, kind), group=group, layout=layout)
    out = model(**batch)
    out.loss.backward()
    grads = _grads(model)
    flat = torch.cat([g.flatten() for g in grads.values()] + [out.loss.detach().reshape(1)])
    dist.all_reduce(flat, group=group)
    offset = 0
    for name, g in grads.items():
        grads[name] = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
    return float(flat[-1]), grads


def compare(ref, got) -> dict:
    (ref_loss, ref_grads), (loss, grads) = ref, got
    floor = ZERO_GRAD * max(r.abs().max().item() for r in ref_grads.values())
    worst, worst_name = 0.0, ""
    for name, r in ref_grads.items():
        scale = max(r.abs().max().item(), floor, 1e-30)
        ratio = (grads[name] - r).abs().max().item() / scale
        if not ratio <= worst:  # NaN counts as worst
            worst, worst_name = ratio, name
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    ok = loss_err <= LOSS_TOL and worst <= GRAD_TOL
    return {"status": "exact" if ok else "wrong", "loss_rel": loss_err, "grad_rel": worst,
            "grad_name": worst_name, "ref_loss": ref_loss, "loss": loss}  # fmt: skip


def _error(err: BaseException) -> dict:
    """refused if ringattn raised it (ValueError/NotImplementedError in ringattn's code)."""
    frames = traceback.extract_tb(err.__traceback__)
    where = (
        f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else ""
    )
    ours = bool(frames) and f"{os.sep}ringattn{os.sep}" in frames[-1].filename
    refused = isinstance(err, (ValueError, NotImplementedError)) and ours
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return {"status": "refused" if refused else "crashed",
            "error": f"{type(err).__name__}: {first}", "where": where}  # fmt: skip


def _copy(model: torch.nn.Module, model_type: str) -> torch.nn.Module:
    """A copy for the CP side: a deep copy, or the same seeded build where buffers refuse one."""
    try:
        return copy.deepcopy(model)
    except RuntimeError:  # recurrent_gemma: a non-leaf tensor attribute
        return build(model_type)


class FamilyTimeout(BaseException):
    """The per-family time limit (a BaseException: the per-case handlers let it through)."""


def _alarm(signum, frame):
    raise FamilyTimeout()


def run_family(model_type: str, group) -> dict:
    """This rank's outcome for one family: build, references, the four CP cases."""
    import torch.distributed as dist

    import ringattn.hf

    try:
        model = build(model_type)
        refs = {kind: reference(model, kind) for kind in KINDS}
    except Exception as err:
        return {"status": "build-failed", **{k: v for k, v in _error(err).items() if k != "status"}}
    cases = {}
    for layout in LAYOUTS:
        try:
            parallel = ringattn.hf.parallelize(_copy(model, model_type), group=group, layout=layout)
        except Exception as err:
            cases.update({f"{layout}/{kind}": _error(err) for kind in KINDS})
            continue
        for kind in KINDS:
            name = f"{layout}/{kind}"
            try:
                cases[name] = compare(refs[kind], cp_case(parallel, kind, layout, group))
            except Exception as err:
                cases[name] = _error(err)
            flag = torch.tensor([float(cases[name]["status"] in ("refused", "crashed"))])
            try:  # a case that failed on one rank only leaves the group unusable: stop here
                dist.all_reduce(flag, group=group)
            except Exception as err:
                cases[name] = {"status": "crashed", "error": f"ranks out of step: {err}"[:300]}
                return {"status": "crashed", "cases": cases}
    return {"status": verdict(cases), "cases": cases}


def verdict(cases: dict) -> str:
    for status in ("wrong", "crashed", "refused"):
        if any(c["status"] == status for c in cases.values()):
            return status
    return "exact"


def worker(families: list[str], jsonl: str, time_limit: float) -> None:
    import torch.distributed as dist
    import transformers

    from ringattn.runtime.launch import init_distributed

    transformers.logging.set_verbosity_error()
    init_distributed(timeout_s=600)
    rank = dist.get_rank()
    signal.signal(signal.SIGALRM, _alarm)
    for model_type in families:
        if rank == 0:
            with open(jsonl, "a") as f:
                f.write(json.dumps({"model_type": model_type, "started": True}) + "\n")
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        start = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, time_limit)
        try:
            result = run_family(model_type, group)
        except FamilyTimeout:
            result = {"status": "crashed", "error": f"timeout: over {time_limit:.0f} s"}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result["seconds"] = round(time.perf_counter() - start, 2)
        outcomes = [None, None]
        dist.all_gather_object(outcomes, result)
        if rank == 0:
            if outcomes[0]["status"] == "exact" and outcomes[1]["status"] != "exact":
                result = {**outcomes[1], "note": "rank 1 only"}
            with open(jsonl, "a") as f:
                f.write(json.dumps({"model_type": model_type, **result}) + "\n")
        dist.destroy_process_group(group)


def _read(jsonl: str) -> tuple[dict[str, dict], list[str]]:
    done, started = {}, []
    if os.path.exists(jsonl):
        with open(jsonl) as f:
            for line in f:
                row = json.loads(line)
                if row.get("started"):
                    started.append(row["model_type"])
                else:
                    done[row["model_type"]] = row
    return done, started


def _line(row: dict) -> str:
    if row["status"] in ("exact",):
        return ""
    if row["status"] == "wrong":
        bad = {n: c for n, c in row["cases"].items() if c["status"] == "wrong"}
        return "; ".join(f"{n}: loss {c['loss_rel']:.1e} grad {c['grad_rel']:.1e} "
                         f"({c['grad_name']})" for n, c in bad.items())  # fmt: skip
    if "cases" in row:
        return next(c.get("error", "") for c in row["cases"].values()
                    if c["status"] == row["status"])  # fmt: skip
    return row.get("error", "")


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ringattn.runtime.launch import LaunchError, LaunchInterrupted, launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="model_types (default: every causal LM)")
    parser.add_argument("--out", default="results/family_survey.json", help="JSON output")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per family")
    parser.add_argument("--resume", action="store_true", help="keep the families already done")
    args = parser.parse_args()
    families = args.families or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    jsonl = args.out.removesuffix(".json") + ".jsonl"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    if not args.resume and os.path.exists(jsonl):
        os.remove(jsonl)
    start = time.perf_counter()
    while True:
        done, started = _read(jsonl)
        todo = [f for f in families if f not in done]
        if not todo:
            break
        try:
            launch(worker, 2, todo, jsonl, args.time_limit, stall_s=600.0)
        except LaunchInterrupted:
            raise
        except LaunchError as err:
            dead = next((f for f in reversed(started) if f not in done), todo[0])
            first = str(err).strip().splitlines()[0][:300]
            with open(jsonl, "a") as f:
                row = {"model_type": dead, "status": "crashed", "error": f"launch died: {first}"}
                f.write(json.dumps(row) + "\n")
    done, _ = _read(jsonl)
    rows = [done[f] for f in families]
    print(f"{'model_type':28} {'verdict':13} detail")
    for row in rows:
        print(f"{row['model_type']:28} {row['status']:13} {_line(row)[:150]}")
    import transformers

    summary = {s: [r["model_type"] for r in rows if r["status"] == s]
               for s in ("exact", "wrong", "crashed", "refused", "build-failed")}  # fmt: skip
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cp": 2, "layouts": LAYOUTS, "kinds": KINDS, "docs": DOCS,
        "gates": {"loss_rel": LOSS_TOL, "grad_rel_to_max": GRAD_TOL,
                  "zero_grad_floor_rel_to_model_max": ZERO_GRAD},
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary,
        "families": {r["model_type"]: r for r in rows},
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print({s: len(v) for s, v in summary.items()}, f"{report['seconds']} s")


if __name__ == "__main__":
    main()
