"""What dynamic CP cannot make exact for a transformers model: refused by name, on every rank.

Dynamic CP (`train --hf --dynamic-cp`, `ContextParallelConfig(dynamic=True)`) runs each rank's
local rows as pieces over sub-groups of the cp group (`ringattn_segments`, attention.py). Only
attention knows about pieces, so only models whose every token mixer is attention qualify:

    refused                         why
    recurrent mixers without a      those that run over the cp group's whole sequence (mixers/;
      state-passing program         whole-sequence layers too), not piece by piece; Mamba2,
                                    gated DeltaNet and short convolutions run each piece over
                                    its sub-group by state passing (mixers/state.py)
    vision-language models          the vision merge and its 3-D positions are cut for one group
                                    (vision.py), not for pieces
    a MoE router loss               its statistics (moe.py) exclude padding rows found from the
      (output_router_logits=True)   group's document bounds, and a rank with no document trains
                                    a one-token placeholder that is in no batch
    experts split over ranks        expert parallelism's all-to-all assumes one token layout

MoE models without the router loss run (experts work token by token), and so does activation
checkpointing (transformers recomputes a layer with the same kwargs, segments included: the same
pieces over the same groups, in the same order on every rank). The checks read the model's
structure only (the same on every rank), before any process group is touched.
"""

from __future__ import annotations

from torch import nn

from ringattn.integrations.hf import mixers, moe, vision
from ringattn.integrations.hf.experts import EXPERTS_ATTR
from ringattn.integrations.hf.mixers.state import has_state

__all__ = ["refuse_dynamic"]


def refuse_dynamic(model: nn.Module, what: str) -> None:
    """ValueError naming the first thing about `model` that `what` (the flag or setting that asked
    for dynamic CP) cannot run exactly (see the module docstring)."""
    name = type(model).__name__
    if vision.is_multimodal(model):
        raise ValueError(
            f"{what}: {name} is a vision-language model; dynamic CP places text documents in "
            f"pieces, which the image merge (cut once per cp group) does not follow; train it "
            f"with static CP (drop {what})"
        )
    text_root = model.get_decoder() if hasattr(model, "get_decoder") else model
    found = [(n, m) for n, m in mixers.find_mixers(text_root) if not has_state(m)]
    if found:
        kinds = sorted({type(m).__name__ for _, m in found})
        raise ValueError(
            f"{what}: {name} has sequence mixers that only run over the cp group's whole "
            f"sequence ({', '.join(kinds)}, e.g. {found[0][0]}), not piece by piece by state "
            f"passing; train this hybrid model with static CP (drop {what})"
        )
    config = model.config.get_text_config()
    if getattr(config, "output_router_logits", False) and moe.router_settings(model):
        raise ValueError(
            f"{what}: {name} adds a MoE router load-balancing loss (output_router_logits=True), "
            f"whose statistics are taken over one cp group's rows; set output_router_logits="
            f"False in the config, or train with static CP (drop {what})"
        )
    split = [n for n, m in model.named_modules() if getattr(m, EXPERTS_ATTR, None) is not None]
    if split:
        raise ValueError(
            f"{what}: {name}'s experts are split over ranks ({split[0]}); dynamic CP does not "
            f"run with expert parallelism: give the model without expert_group (or --ep 1)"
        )
