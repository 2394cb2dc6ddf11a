"""Rank functions for vision-language models under CP (test_hf_vlm.py; harness.py conventions).

Tiny Qwen2-VL (a 1-block vision tower with 2x2 patch merging, 3-D M-RoPE text decoder) and LLaVA
(a CLIP vision tower, a Llama decoder), random weights from seed 0, eager attention. The batches
are what a processor returns, built by hand (no downloads): input_ids with the image placeholder
tokens, pixel_values, and for Qwen2-VL image_grid_thw and mm_token_type_ids. The reference is the
same weights on one process; the CP side a deep copy, parallelized, fed by `shard_batch`.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import ringattn.hf

VOCAB, IMAGE, VIDEO, VSTART, VEND = 100, 97, 98, 96, 95
QWEN_GRIDS = ([1, 4, 6], [1, 4, 4])  # (t, h, w) patches: 6 and 4 merged tokens
LLAVA_TOKENS = 16  # (8 / 2)^2 patches per image, the CLS token dropped


def _config(arch: str):
    import transformers as tf

    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if arch == "qwen2_vl":
        rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
        vision = {
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 32,
            "num_heads": 2,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "temporal_patch_size": 1,
        }
        return tf.Qwen2VLConfig(
            text_config={**text, "rope_parameters": rope},
            vision_config=vision,
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=VSTART,
            vision_end_token_id=VEND,
            attn_implementation="eager",
        )
    if arch == "llava":
        vision = tf.CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=8,
            patch_size=2,
        )
        return tf.LlavaConfig(
            vision_config=vision,
            text_config=tf.LlamaConfig(**text),
            image_token_id=IMAGE,
            vision_feature_layer=-1,
            attn_implementation="eager",
        )
    if arch == "gemma3":  # image tokens attend bidirectionally: refused
        return tf.Gemma3Config(
            text_config=tf.Gemma3TextConfig(head_dim=8, **text),
            vision_config=tf.SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=8,
                patch_size=2,
            ),
        )
    raise ValueError(f"unknown VLM test architecture {arch!r}")


_MODELS: dict[str, torch.nn.Module] = {}


def build(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    if arch not in _MODELS:
        torch.manual_seed(0)
        _MODELS[arch] = AutoModelForImageTextToText.from_config(_config(arch)).float()
    return _MODELS[arch]


def data(arch: str, images: int) -> dict[str, torch.Tensor]:
    """A processor's output for text, `images` images, text: input_ids, labels (-100 on the image
    tokens), pixel_values (+ image_grid_thw, mm_token_type_ids for Qwen2-VL). images = 0 with
    Qwen2-VL: one 2-frame video instead (pixel_values_videos, video_grid_thw)."""
    gen = torch.Generator().manual_seed(images)
    pieces, pixels = [torch.randint(0, 90, (5,), generator=gen)], []
    if images == 0:  # a video: (t, h, w) = (2, 4, 4) patches, 8 merged tokens
        pixels.append(torch.randn(32, 3 * 2 * 2, generator=gen))
        pieces += [torch.tensor([VSTART]), torch.full((8,), VIDEO), torch.tensor([VEND])]
        pieces.append(torch.randint(0, 90, (9,), generator=gen))
    for i in range(images):
        if arch == "qwen2_vl":
            grid = QWEN_GRIDS[i]
            tokens = grid[0] * grid[1] * grid[2] // 4
            pixels.append(torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 2, generator=gen))
            pieces += [torch.tensor([VSTART]), torch.full((tokens,), IMAGE), torch.tensor([VEND])]
        else:
            pixels.append(torch.randn(1, 3, 8, 8, generator=gen))
            pieces.append(torch.full((LLAVA_TOKENS,), IMAGE))
        pieces.append(torch.randint(0, 90, (7 + 2 * i,), generator=gen))
    ids = torch.cat(pieces)[None]  # (1, S)
    labels = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)
    batch = {"input_ids": ids, "labels": labels}
    if images == 0:
        batch["pixel_values_videos"] = pixels[0]
        batch["video_grid_thw"] = torch.tensor([[2, 4, 4]])
        batch["mm_token_type_ids"] = (ids == VIDEO).int() * 2
        return batch
    batch["pixel_values"] = torch.cat(pixels)
    if arch == "qwen2_vl":
        batch["image_grid_thw"] = torch.tensor(QWEN_GRIDS[:images])
        batch["mm_token_type_ids"] = (ids == IMAGE).int()
    return batch


_REFERENCES: dict[tuple, tuple] = {}


def reference(arch: str, images: int):
    if (arch, images) not in _REFERENCES:
        model = build(arch)
        model.zero_grad(set_to_none=True)
        out = model(**data(arch, images), use_cache=False)
        out.loss.backward()
        grads = {
            n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters()
        }
        _REFERENCES[(arch, images)] = (out.loss.item(), grads)
    return _REFERENCES[(arch, images)]


def compare(rank, world_size, *, arch, cases):
    """Per (layout, strategy, images): rank 0 returns (case, loss rel. error, worst gradient
    error / its tensor's max entry, that tensor, local logits length, vision tower gradient
    max)."""
    rows = []
    for layout, strategy, images in cases:
        model = ringattn.hf.parallelize(
            copy.deepcopy(build(arch)), layout=layout, strategy=strategy
        )
        out = model(**ringattn.hf.shard_batch(data(arch, images), layout=layout))
        out.loss.backward()
        params = list(model.named_parameters())
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for _, p in params]
            + [out.loss.detach().reshape(1)]
        )
        dist.all_reduce(flat)
        if rank != 0:
            continue
        ref_loss, ref_grads = reference(arch, images)
        worst, worst_name, offset, tower = 0.0, "", 0, 0.0
        largest = max(g.abs().max().item() for g in ref_grads.values())
        for name, p in params:
            got = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            scale = ref_grads[name].abs().max().item()
            if "visual" in name or "vision_tower" in name:
                tower = max(tower, scale)
            # floored at 1e-4 of the largest gradient: a key bias's gradient is 0 in exact
            # arithmetic (softmax ignores it), and rounding noise is all that is left of it
            ratio = (got - ref_grads[name]).abs().max().item() / max(scale, 1e-4 * largest)
            if not ratio <= worst:
                worst, worst_name = ratio, name
        rows.append(
            (
                (layout, strategy, images),
                abs(float(flat[-1]) - ref_loss) / ref_loss,
                worst,
                worst_name,
                out.logits.shape[1],
                tower,
            )
        )
    return rows if rank == 0 else None


def refused(rank, world_size, *, arch):
    ringattn.hf.parallelize(copy.deepcopy(build(arch)))


def generate_equal(rank, world_size, *, arch, images, layout, new_tokens=5):
    """ringattn.hf.generate with the images equals model.generate's greedy tokens."""
    model = build(arch).eval()
    batch = data(arch, images)
    batch.pop("labels")
    ids = batch.pop("input_ids")
    got = ringattn.hf.generate(model, ids, new_tokens, layout=layout, eos_token_id=[], **batch)
    want = model.generate(
        input_ids=ids,
        **batch,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    model.train()
    return got.tolist(), want.tolist()
