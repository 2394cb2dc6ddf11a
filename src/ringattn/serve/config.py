"""`ringattn serve`'s settings (one field per flag) and the checks made before any launch.

check(cfg)  the model directory has a config and a tokenizer (the server speaks text), --nproc
            and --tp agree and the model splits over --tp (its own tp plan), the port can be
            bound on --host, FastAPI and uvicorn import: every mistake a ValueError in the
            parent, before any rank starts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ringattn.integrations.hf.experts import check_ep
from ringattn.integrations.hf.source import DTYPES, load_config, model_source
from ringattn.integrations.hf.tensor_parallel import check_tensor_parallel
from ringattn.layout import LAYOUTS
from ringattn.runtime.extras import require
from ringattn.runtime.flags import check_at_least, check_choice

__all__ = ["ServeConfig", "bind", "check", "model_aliases", "model_name"]


@dataclass
class ServeConfig:
    hf: str | None = None
    """a local Hugging Face model directory with its tokenizer (a bare config.json: random init
    from --seed)"""
    nproc: int = 1
    """ranks the KV cache is sharded over"""
    tp: int = 1
    """tensor-parallel degree: heads and MLP split over tp by the model's own tp plan, each
    prompt over cp = nproc / tp"""
    ep: int = 1
    """MoE models: expert-parallel degree, each MoE layer's experts split over blocks of ep
    ranks (a divisor of --nproc and of the expert count; --tp 1)"""
    host: str = "127.0.0.1"
    """interface to listen on (loopback by default)"""
    port: int = 8000
    """TCP port (0: any free port)"""
    model_name: str | None = None
    """the model id in the API (default: --hf as given, as vLLM; the directory's basename is
    accepted too)"""
    api_key: str | None = None
    """require 'Authorization: Bearer KEY' on every request (default: $RINGATTN_API_KEY, which
    other users cannot see in ps)"""
    layout: str = "zigzag"
    """how each prompt is sharded"""
    seed: int = 0
    """seed of a random init (no weights)"""
    max_batch: int = 32
    """sequences running at once (prefilling or decoding); more wait in the queue"""
    max_batch_tokens: int = 1024
    """prompt tokens prefilled per step, beside the running sequences' decodes; a longer prompt
    goes in chunks of this many tokens (the prefix cache keeps each chunk). A running stream
    waits one chunk's prefill per step: 1024 keeps that under an eighth of an 8k prompt's"""
    kv_cache_gb: float | None = None
    """the KV pool of each rank in GiB (default: 0.8 x the free GPU memory after loading the model,
    4 GiB on the CPU)"""
    kv_block_size: int = 16
    """tokens per KV block (the pool's unit, and the prefix cache's: a shared prefix is reused
    in whole blocks)"""
    prefix_cache: bool = True
    """reuse the cached K/V of a shared prompt prefix (whole blocks, by chained content hash)"""
    max_model_len: int | None = None
    """the longest prompt + completion served (default: the model's context); the KV pool must
    hold one sequence this long, or the server does not start (vLLM's --max-model-len)"""
    max_queue: int = 256
    """requests that may wait for the ranks; beyond, 503 with Retry-After (0: no limit)"""
    max_body_mb: float | None = None
    """the largest request body in MiB, 413 beyond (None: 32 bytes per context token, at least 1
    MiB)"""
    dtype: str = "auto"
    """the weights' dtype (auto: the checkpoint's)"""


def model_name(cfg: ServeConfig) -> str:
    """The served model id: --model-name, else --hf as given on the command line (vLLM's
    convention: clients name the model as the user launched it)."""
    return cfg.model_name or cfg.hf


def model_aliases(cfg: ServeConfig) -> tuple[str, ...]:
    """Other names a request may give the model: the directory's basename (the id before
    --hf's path became the default) and --hf as given, when --model-name replaced them."""
    names = (os.path.basename(os.path.normpath(cfg.hf)), cfg.hf)
    return tuple(n for n in dict.fromkeys(names) if n != model_name(cfg))


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); ValueError with the fix when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({err.strerror}); pick another --port "
                         f"or --host") from None  # fmt: skip
    sock.listen(128)
    return sock


def check(cfg: ServeConfig) -> None:
    """Every flag mistake as a ValueError, before any process starts (see the docstring)."""
    require("serve", "ringattn serve")
    if cfg.hf is None:
        raise ValueError("ringattn serve needs --hf DIR (a local Hugging Face model directory)")
    check_at_least("nproc", cfg.nproc, 1)
    check_at_least("tp", cfg.tp, 1)
    check_at_least("max-batch", cfg.max_batch, 1)
    check_at_least("max-queue", cfg.max_queue, 0)
    check_at_least("max-batch-tokens", cfg.max_batch_tokens, 1)
    check_at_least("kv-block-size", cfg.kv_block_size, 1)
    if cfg.max_model_len is not None:
        check_at_least("max-model-len", cfg.max_model_len, 2)
    if cfg.kv_cache_gb is not None and not cfg.kv_cache_gb > 0:
        raise ValueError(f"--kv-cache-gb must be > 0, got {cfg.kv_cache_gb}")
    check_choice("dtype", cfg.dtype, DTYPES)
    if cfg.max_body_mb is not None and not cfg.max_body_mb > 0:
        raise ValueError(f"--max-body-mb must be > 0, got {cfg.max_body_mb}")
    if cfg.nproc % cfg.tp:
        raise ValueError(f"--tp {cfg.tp} must divide --nproc {cfg.nproc} (cp = nproc / tp)")
    check_choice("layout", cfg.layout, LAYOUTS)
    if not 0 <= cfg.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {cfg.port}")
    if cfg.api_key is not None and not cfg.api_key.strip():
        raise ValueError("--api-key is empty; give a key or drop the flag")
    source = model_source(cfg.hf)
    check_tensor_parallel(load_config(source), cfg.tp)
    if cfg.ep != 1 and (
        not isinstance(cfg.ep, int) or cfg.ep < 1 or cfg.nproc % cfg.ep or cfg.tp > 1
    ):
        raise ValueError(
            f"--ep {cfg.ep} must divide --nproc {cfg.nproc}, with --tp 1 (got {cfg.tp})"
        )
    check_ep(cfg.ep, load_config(source))
    if source.tokenizer_dir is None:
        raise ValueError(
            f"--hf {cfg.hf}: no tokenizer files in {source.directory}; the server takes and "
            f"returns text, so save the model's tokenizer there"
        )
    if cfg.port != 0:
        bind(cfg.host, cfg.port).close()  # in use, or a host we cannot listen on: say so now
