"""Model level: prefill and cached greedy decode latency of a model before and after ``normswap.convert``
(fold + swap), several copies of each timed interleaved in one process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


def _prefill(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


def _decode(model: nn.Module, ids: torch.Tensor, steps: int) -> tuple[list[int], float]:
    """Greedy decode ``steps`` tokens after the prompt with the KV cache.

    Returns the token ids and the seconds the ``steps`` one-token forwards took (prompt excluded).
    """
    out = model(ids, use_cache=True)
    cache, tok, toks = out.cache, out.logits[:, -1:].argmax(-1), []  # transformers 5: "cache"
    t0 = time.perf_counter()
    for _ in range(steps):
        toks.append(int(tok))
        out = model(tok, cache=cache, use_cache=True)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    return toks, time.perf_counter() - t0


def bench_model(
    source: str = "smollm2-135m",
    prompt_len: int = 512,
    decode_tokens: int = 32,
    rounds: int = 5,
    dtype: str = "float32",
    copies: int = 2,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Latency of the original and the converted model, measured side by side.

    Loads ``source`` (``normswap.io.load_model``), makes ``copies`` deep copies of it as it is and
    ``copies`` converted with ``normswap.convert.convert`` (fold + swap, default options), and times them
    all, rotating which goes first each round: ``prefill`` (one forward over ``1 x prompt_len`` random
    ids, no cache) and ``decode`` (``decode_tokens`` greedy one-token steps with the KV cache after a
    ``1 x 16`` prompt; the prompt's forward is not timed).

    Several copies, because where a model's weights land in memory matters: identical copies of
    SmolLM2-135M differed by up to 18% here. Each row pools its copies' samples; ``copy_medians_s`` shows
    that spread, and a converted/original ratio inside it is noise. (Copies also give every model freshly
    allocated, aligned weights: GGUF-loaded ones can sit at 16-byte offsets, which alone slowed decode.)

    Returns:
        One dict per (phase, model in ``"original"``, ``"converted"``): ``phase, model, median_s`` (over
        all copies and rounds), ``copy_medians_s``, ``ratio_to_original``, ``tokens_agree`` (decode:
        whether every copy produced the original's greedy tokens).

    Raises:
        ValueError: ``rounds`` or ``copies`` below 1.
        normswap.errors.NormswapError: the model cannot be loaded or converted.
    """
    import copy

    from normswap.convert import convert
    from normswap.io import load_model

    for name, value in (("rounds", rounds), ("copies", copies)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    loaded = load_model(source, dtype=dtype, tokenizer=False).model
    models = {}
    for i in range(copies):
        models[("original", i)] = copy.deepcopy(loaded)
    for i in range(copies):
        models[("converted", i)] = convert_copy = copy.deepcopy(loaded)
        convert(convert_copy)
    del loaded
    vocab = models[("original", 0)].config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g, device="cpu")
    short = torch.randint(0, vocab, (1, 16), generator=g, device="cpu")
    times = {(ph, key): [] for ph in ("prefill", "decode") for key in models}
    tokens = {}
    with torch.inference_mode():
        for key, m in models.items():  # warm-up
            _prefill(m, prompt)
            tokens[key] = _decode(m, short, decode_tokens)[0]
        keys = list(models)
        for r in range(rounds):
            k = r % len(keys)
            for key in keys[k:] + keys[:k]:
                t0 = time.perf_counter()
                _prefill(models[key], prompt)
                times[("prefill", key)].append(time.perf_counter() - t0)
                times[("decode", key)].append(_decode(models[key], short, decode_tokens)[1])
            if log is not None:
                log(f"model round {r + 1}/{rounds}")
    rows = []
    for phase in ("prefill", "decode"):
        pooled = {
            v: [t for i in range(copies) for t in times[(phase, (v, i))]] for v in ("original", "converted")
        }
        base = statistics.median(pooled["original"])
        for v in ("original", "converted"):
            med = statistics.median(pooled[v])
            rows.append(
                {
                    "phase": phase,
                    "model": v,
                    "source": source,
                    "prompt_len": prompt_len if phase == "prefill" else 16,
                    "decode_tokens": decode_tokens if phase == "decode" else 0,
                    "median_s": med,
                    "copy_medians_s": [statistics.median(times[(phase, (v, i))]) for i in range(copies)],
                    "ratio_to_original": med / base,
                    "tokens_agree": all(tokens[(v, i)] == tokens[("original", 0)] for i in range(copies)),
                }
            )
    return rows
