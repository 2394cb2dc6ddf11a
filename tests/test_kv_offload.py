"""KV-cache offload (`ShardedKVCache.offload()`, `ringattn generate --offload-kv`) on CPU.

The same code path as CUDA's, with plain copies instead of a side stream: the prefetched copy of
the next layer must be patched for the token appended and the rows evicted after it was taken,
so every `kept` must equal the plain (device-resident) cache's exactly, and decoding with it must
give the plain decoder's logits bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from ringattn.inference import ShardedKVCache
from ringattn.inference.hf.engine import KVEngine
from workers_inference import build_model


def _kv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen)


def test_offloaded_cache_equals_the_plain_one_with_prefetch_append_and_evict():
    """Rank 1 of 2, 3 layers, a window of 5: a prefill, decoded tokens round-robin (this rank
    keeps every other one), a follow-up turn of 4 tokens, more decoding; each layer's prefetched
    copy (taken while the previous layer ran) is used after its layer appended and evicted."""
    gen = torch.Generator().manual_seed(0)
    plain, offloaded = ShardedKVCache(3, 1, 2, window=5), ShardedKVCache(3, 1, 2, window=5)
    offloaded.offload()
    position = 0

    def store(n: int) -> None:
        nonlocal position
        positions = torch.arange(position, position + n)
        for layer in range(3):
            k, v = _kv(n, gen)
            for cache in (plain, offloaded):
                cache.store(layer, k, v, positions)
                cache.evict(layer, position + n)
        position += n

    def decode(steps: int) -> None:
        nonlocal position
        for _ in range(steps):
            owner = plain.next_owner()
            for layer in range(3):
                k, v = _kv(1, gen)
                for cache in (plain, offloaded):
                    cache.append_decoded(layer, k, v, position, owner)
                    cache.evict(layer, position)
                got, want = offloaded.kept(layer), plain.kept(layer)
                for a, b in zip(got, want, strict=True):
                    assert torch.equal(a, b), (position, layer)
                assert (layer + 1) % 3 in offloaded._copies  # the next layer was prefetched
            for cache in (plain, offloaded):
                cache.decoded += 1
            position += 1

    store(9)  # rank 1's share of a prompt, as the decoder stores it
    decode(7)
    store(4)
    decode(6)
    assert offloaded.nbytes == plain.nbytes > 0 and offloaded.tokens == plain.tokens


def test_offloaded_decoder_gives_the_plain_logits_exactly():
    """The project's decoder, one process: prefill, 6 steps, a follow-up turn (pass-KV, then
    pass-Q), 4 more steps, with and without a window; every logits vector equal to float32
    rounding (the plain engine reads pages in place, the offloaded one contiguous copies: the
    kernel's sums may round apart) and the same greedy tokens."""
    model = build_model()
    prompt = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1))
    follow_up = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(2))
    for window, mode in ((None, "pass-kv"), (6, "pass-q")):
        runs = []
        for offload in (False, True):
            engine = KVEngine(model, layout="zigzag", window=window, offload=offload)
            logits = [engine.prefill([prompt])[0]]
            for _ in range(6):
                logits.append(engine.decode([0], [int(logits[-1].argmax())])[0])
            logits.append(engine.extend(0, follow_up, mode))
            for _ in range(4):
                logits.append(engine.decode([0], [int(logits[-1].argmax())])[0])
            runs.append(logits)
        for i, (a, b) in enumerate(zip(*runs, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{window}, {i}")
            assert int(a.argmax()) == int(b.argmax()), (window, i)
        assert len({int(x.argmax()) for x in runs[0]}) > 1  # the tokens vary


def test_offloaded_hf_engine_holds_at_most_the_next_layer_and_equals_the_plain_one():
    """The HF engine keeps one cache per (layer, sequence): a decode step must leave at most one
    prefetched device copy per sequence (the next token's layer 0), not a copy of every layer,
    and its logits must equal the plain (paged) engine's to float32 rounding, same tokens."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))
               for n in (9, 5)]  # fmt: skip
    runs = []
    for offload in (False, True):
        engine = KVEngine(model, offload=offload)
        with torch.no_grad():
            logits = [engine.prefill(prompts)]
            for _ in range(3):
                logits.append(engine.decode([0, 1], logits[-1].argmax(-1).tolist()))
                copies = sum(len(getattr(c, "_copies", ())) for c in engine.state.caches.values())
                assert copies <= (2 if offload else 0), copies  # one per sequence at most
        runs.append(logits)
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_decoding_appends_and_evicts_without_reading_the_device():
    """The decode path's cache work (append a token, evict out of the window, read the kept
    rows) never reads device memory, so it never syncs the host per layer: on the meta device,
    whose tensors hold no data, any read raises; the host copy of the positions is what counts."""
    meta = torch.device("meta")
    cache = ShardedKVCache(2, 0, 1, window=4)
    k = torch.empty(1, 2, 6, 4, device=meta)
    positions = torch.arange(6, device=meta)
    for layer in range(2):
        cache.store(layer, k, k, positions, host=torch.arange(6, device="cpu"))
    for position in range(6, 12):
        for layer in range(2):
            one = torch.empty(1, 2, 1, 4, device=meta)
            cache.append_decoded(layer, one, one, position, owner=0)
            cache.evict(layer, position)
            kept_k, _, _ = cache.kept(layer)
            assert kept_k.shape[2] == 5  # the window: position - 4 .. position
    assert cache.layers[0].host[cache.layers[0].start : cache.layers[0].length].tolist() == [
        7, 8, 9, 10, 11]  # fmt: skip
