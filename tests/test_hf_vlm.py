"""Vision-language models under CP: the summed loss and gradients equal one process's.

Qwen2-VL (3-D M-RoPE positions from image_grid_thw and mm_token_type_ids, a vision tower with its
own attention and 2x2 patch merging) with one image, two images and a 2-frame video at CP = 2
and 3, and LLaVA (a CLIP vision tower and a Llama decoder, another family), tiny random-weight
configs; zigzag and striped, ring and all-gather. The batch is what a processor returns, built
by hand. Reference: the same weights with eager attention on one process. Gates: loss relative
1e-5, gradients (the vision tower's included) 1e-4 of each tensor's largest entry. Also: greedy
ringattn.hf.generate with the images equals model.generate, families that cannot be supported
raise naming their setting, and shard_batch keeps the multimodal inputs whole.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import ringattn.hf
import workers_hf_vlm

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
# (layout, strategy, images); 0 images: one 2-frame video instead (Qwen2-VL only)
CASES = [
    ("zigzag", "ring", 1),
    ("striped", "allgather", 2),
    ("zigzag", "allgather", 2),
    ("striped", "ring", 0),
]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("arch", ["qwen2_vl", "llava"])
def test_vlm_matches_single_device(pools, arch, world_size):
    cases = CASES if arch == "qwen2_vl" else CASES[:2]  # LLaVA: images only
    rows = pools(world_size).run("workers_hf_vlm:compare", arch=arch, cases=cases, timeout=600)[0]
    assert [row[0] for row in rows] == cases
    failures = []
    for case, loss_error, grad_error, name, local_len, tower in rows:
        assert tower > 0, f"{case}: the vision tower got no gradient"
        if not loss_error <= LOSS_RTOL:
            failures.append(f"{case}: loss relative error {loss_error:.3g}")
        if not grad_error <= GRAD_RTOL:
            failures.append(f"{case}: gradient {name} error {grad_error:.3g} of its max entry")
        full = workers_hf_vlm.data(arch, case[2])["input_ids"].shape[1]
        assert local_len < full * 2 / world_size + 4, (case, local_len)  # this rank's rows only
    assert not failures, f"{arch} at CP = {world_size}:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    ("arch", "world_size", "images", "layout"),
    [("qwen2_vl", 2, 2, "zigzag"), ("llava", 3, 1, "striped")],
)
def test_generate_with_images_equals_model_generate(pools, arch, world_size, images, layout):
    results = pools(world_size).run(
        "workers_hf_vlm:generate_equal", arch=arch, images=images, layout=layout
    )
    for got, want in results:
        assert got == want


def test_unsupported_family_names_its_setting():
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):  # no weights needed to be refused
        model = AutoModelForImageTextToText.from_config(workers_hf_vlm._config("gemma3"))
    with pytest.raises(ValueError, match=r"model_type='gemma3'.*bidirectionally"):
        ringattn.hf.parallelize(model)


def test_mask_overlay_raises_instead_of_a_wrong_loss():
    """A text model whose masks carry an overlay (Gemma 3 with use_bidirectional_attention):
    transformers' or_mask_function cannot be applied by ringattn, so the forward raises."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        use_bidirectional_attention=True,
    )
    model = ringattn.hf.parallelize(AutoModelForCausalLM.from_config(config))
    ids = torch.arange(9).unsqueeze(0)
    with pytest.raises(ValueError, match="mask overlay"):
        model(**ringattn.hf.shard_batch({"input_ids": ids, "labels": ids}))


def test_shard_batch_keeps_multimodal_inputs_whole():
    batch = workers_hf_vlm.data("qwen2_vl", 2)
    local = ringattn.hf.shard_batch(batch, layout="zigzag")
    for key in ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
        assert local[key] is batch[key]
    assert "position_ids" not in local  # the model computes 3-D M-RoPE positions itself
    index = ringattn.positions(batch["input_ids"].shape[1], cu_seqlens=[0, 35])
    want = torch.cat([batch["labels"][0, 1:], torch.tensor([-100])])
    assert local["labels"][0, index >= 0].tolist() == want[index[index >= 0]].tolist()
    with pytest.raises(ValueError, match="packing several multimodal documents"):
        ringattn.hf.shard_batch({**batch, "cu_seqlens": [0, 20, 35]})


def test_flash_attention_in_the_vision_tower_is_refused():
    """A flash vision tower would take shard_batch's cu_seq_lens_q as its own: refused."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(workers_hf_vlm._config("qwen2_vl"))
    model.config.vision_config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"vision_config uses attn_implementation='flash_att"):
        ringattn.hf.parallelize(model)
