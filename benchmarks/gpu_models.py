"""Random-weight models for the GPU acceptance run (benchmarks/gpu_check.sh), and their timings.

    python benchmarks/gpu_models.py make llama --size 1b --device cuda --out DIR
    python benchmarks/gpu_models.py time ORIGINAL_DIR CONVERTED_DIR --device cuda --json timings.json

``make`` writes a plain transformers checkpoint (safetensors, config, tokenizer) of a Llama (16 layers,
hidden 2048, vocab 32000: 0.97B parameters at ``--size 1b``) or a Gemma-3-style text model (12 layers,
hidden 1152, 4 heads of 256, one KV head, vocab 65536, sliding-window layers: 0.49B), in bfloat16, built
on ``--device`` (fast random init on a GPU). Norm weights are re-randomized by behaviour, not through
normswap: every module whose class name ends in "Norm" gets ``base + U(-0.5, 0.5)`` around its initial
value (1 for ``w`` norms, 0 for Gemma's ``1+w``), so a norm normswap missed would still move the logits.
The tokenizer is a byte-level BPE (1024 tokens) trained here on Python's bundled pydoc text: the machine
has no network, and ``normswap convert`` checks on real text. ``--size tiny`` (hidden 64, 2 layers) is the
CPU dry run of the same code.

``time`` loads the original (transformers) and the converted checkpoint (``normswap.load_pretrained``,
fused norms in place) on ``--device`` and times, in alternating rounds, a prefill of ``--batch`` x
``--prefill`` tokens (``logits_to_keep=1``) and a decode of ``--decode`` tokens one at a time with a KV
cache; medians in ms. With ``--compiled`` it also times decoding as production runs it: transformers'
compiled static-cache path (``generate(cache_implementation="static")`` with a ``CompileConfig``:
``torch.compile`` of the decode step, ``fullgraph=True``, mode ``reduce-overhead``, i.e. CUDA graphs on a
GPU). Per token = (time of ``generate`` to ``--decode`` + 2 new tokens - time to 2 new tokens) / ``--decode``,
both calls with the same static cache size (a stopping criterion ends the shorter one), so the eager prefill
and the cache set-up cancel. After a warm-up that compiles, the timed calls run under
``torch.compiler.set_stance("fail_on_recompile")``: a recompile per call fails the part, as does a graph
break (``fullgraph``). Exit 1 when the converted model is slower than the original by more than
``--slack`` (default 3%: round-to-round noise of a GPU at these sizes) in any phase.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

import click
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {
    ("llama", "1b"): dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                          max_position_embeddings=4096, tie_word_embeddings=True),
    ("llama", "tiny"): dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512,
                            tie_word_embeddings=True),
    ("gemma3_text", "1b"): dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=12,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=65536,
                                max_position_embeddings=4096, sliding_window=512),
    ("gemma3_text", "tiny"): dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=1024,
                                  max_position_embeddings=512, sliding_window=64),
}  # fmt: skip
TOKENIZER_VOCAB = 1024


def _tokenizer():
    """A byte-level BPE tokenizer trained on the pydoc text (offline, ~2 s), as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from normswap.check.text import default_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([default_text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@torch.no_grad()
def _randomize_norms(model: torch.nn.Module, seed: int = 1) -> int:
    """Every module whose class name ends in "Norm": each float parameter moved to its initial mean (1 or 0)
    plus U(-0.5, 0.5). Returns how many modules were changed."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    count = 0
    for module in model.modules():
        if not type(module).__name__.endswith("Norm"):
            continue
        params = [p for p in module.parameters(recurse=False) if p.is_floating_point()]
        for p in params:
            base = p.float().mean().round().item()
            noise = torch.rand(p.shape, generator=gen, dtype=torch.float64, device="cpu") - 0.5
            p.copy_((base + noise).to(p.device, p.dtype))
        count += bool(params)
    return count


@click.group()
def main() -> None:
    """Models and timings for benchmarks/gpu_check.sh."""


@main.command()
@click.argument("model_type", type=click.Choice(["llama", "gemma3_text"]))
@click.option("--size", type=click.Choice(["1b", "tiny"]), default="1b", show_default=True)
@click.option("--device", default="cuda", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
def make(model_type, size, device, out):
    """Write a random-weight MODEL_TYPE checkpoint (bfloat16, norms re-randomized, a tokenizer) to --out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SIZES[(model_type, size)])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    norms = _randomize_norms(model)
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"make: {model_type} {size}: {params / 1e9:.2f}B parameters, {norms} norms re-randomized, "
          f"saved to {out} in {time.perf_counter() - t0:.1f} s")  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


class _StopAt:
    """A stopping criterion: stop once the sequence is ``length`` tokens long (the static cache's size is
    set by ``max_new_tokens``, so two calls with one size can stop at different lengths)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[-1] >= self.length
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _compiled_generate(model, prompt, max_new: int, stop_after: int):
    """transformers' compiled static-cache decoding of ``stop_after`` new tokens (cache for ``max_new``)."""
    from transformers import StoppingCriteriaList

    with torch.no_grad():
        model.generate(
            prompt, max_new_tokens=max_new, do_sample=False, cache_implementation="static",
            stopping_criteria=StoppingCriteriaList([_StopAt(prompt.shape[-1] + stop_after)]), pad_token_id=0,
        )  # fmt: skip


def _setup_compiled(model, backend: str, mode: str | None, device: torch.device) -> None:
    """Give ``model`` transformers' compile config (fullgraph) and no end-of-sequence token (random weights
    would stop decoding at random)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, **({"mode": mode} if mode else {}))
    if device.type != "cuda":  # transformers compiles decoding on CUDA only unless told otherwise
        config._compile_all_devices = True
    model.generation_config.compile_config = config
    model.generation_config.eos_token_id = None


@torch.no_grad()
def _prefill(model, ids):
    model(input_ids=ids, use_cache=False, logits_to_keep=1)


@torch.no_grad()
def _decode(model, prompt, steps: int):
    from transformers import DynamicCache

    # the cache is updated in place; its keyword is `cache` in newer transformers, `past_key_values` before
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = {keyword: DynamicCache(config=model.config)}
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(input_ids=token, use_cache=True, **cache)
        token = out.logits[:, -1:].argmax(-1)


@main.command("time")
@click.argument("original", type=click.Path(exists=True, file_okay=False))
@click.argument("converted", type=click.Path(exists=True, file_okay=False))
@click.option("--device", default="cuda", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--prefill", type=int, default=2048, show_default=True, help="Tokens per prefill row.")
@click.option("--decode", type=int, default=64, show_default=True, help="Decode steps (after a 128 prompt).")
@click.option("--rounds", type=int, default=7, show_default=True)
@click.option("--slack", type=float, default=0.03, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path))
@click.option("--compiled", is_flag=True, help="Also decode under transformers' compiled static cache.")
@click.option("--compile-backend", default="inductor", show_default=True, help="torch.compile backend.")
@click.option(
    "--compile-mode", default="reduce-overhead", show_default=True, help='"" for the backend\'s default.'
)
def time_command(original, converted, device, dtype, batch, prefill, decode, rounds, slack, json_path,
                 compiled, compile_backend, compile_mode):  # fmt: skip
    """Prefill and decode times of ORIGINAL vs CONVERTED (medians over alternating rounds)."""
    from transformers import AutoModelForCausalLM

    import normswap
    from normswap.device import resolve_device

    dev = resolve_device(device)
    dt = getattr(torch, dtype)
    placement = {"device_map": str(dev)} if dev.type != "cpu" else {}
    models = {
        "original": AutoModelForCausalLM.from_pretrained(original, dtype=dt, **placement).eval(),
        "converted": normswap.load_pretrained(converted, dtype=dt, **placement),
    }
    vocab = models["original"].config.get_text_config().vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prefill), generator=gen, device="cpu").to(dev)
    prompt = torch.randint(0, vocab, (1, 128), generator=gen, device="cpu").to(dev)
    parts = ("prefill", "decode") + (("decode_compiled",) if compiled else ())
    times = {(name, part): [] for name in models for part in (*parts, "compiled_short", "compiled_full")}
    for model in models.values():  # warm-up: kernels chosen, caches allocated
        _prefill(model, ids)
        _decode(model, prompt, 2)
    result = {"device": str(dev), "dtype": dtype, "batch": batch, "prefill_tokens": prefill,
              "decode_steps": decode, "rounds": rounds, "slack": slack}  # fmt: skip
    if compiled:
        result["compile"] = _warm_compiled(models, prompt, decode, compile_backend, compile_mode, dev)
    for _ in range(rounds):
        for name, model in models.items():
            times[(name, "prefill")].append(_timed(lambda m=model: _prefill(m, ids), dev))
            times[(name, "decode")].append(_timed(lambda m=model: _decode(m, prompt, decode), dev) / decode)
            if compiled:  # the decode steps' time: a full generate less a short one (medians below)
                with _no_recompile():
                    short = _timed(lambda m=model: _compiled_generate(m, prompt, decode + 2, 2), dev)
                    full = _timed(lambda m=model: _compiled_generate(m, prompt, decode + 2, decode + 2), dev)
                times[(name, "compiled_short")].append(short)
                times[(name, "compiled_full")].append(full)
    if compiled:
        from torch._dynamo.utils import counters

        result["compile"]["unique_graphs_after_timing"] = counters["stats"]["unique_graphs"]
    slower = []
    labels = {
        "prefill": f"prefill ({batch}x{prefill} tokens)",
        "decode": "decode, eager (ms/token)",
        "decode_compiled": f"decode, compiled static cache ({compile_backend} {compile_mode}) (ms/token)",
    }
    unmeasured = []
    for part in parts:
        a, b = (_median_ms(times, name, part, decode) for name in models)
        if a <= 0 or b <= 0:  # a difference of two timings below their noise (a loaded CPU): no verdict
            result[part] = {"original_ms": a, "converted_ms": b, "ratio": None}
            print(f"time: {labels[part]}: {a:.3f} -> {b:.3f} ms: not measured (below the timing noise)")
            unmeasured.append(part)
            continue
        result[part] = {"original_ms": a, "converted_ms": b, "ratio": b / a}
        print(f"time: {labels[part]}: {a:.3f} -> {b:.3f} ms (converted / original {b / a:.3f})")
        if b > a * (1 + slack):
            slower.append(part)
    result["passed"] = not slower
    result["unmeasured"] = unmeasured
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    ratios = ", ".join(f"{part} {result[part]['ratio']:.3f}" for part in parts if part not in unmeasured)
    if slower:
        print(f"time: converted / original {ratios}: slower by more than {slack:.0%} in {', '.join(slower)}")
        sys.exit(1)
    print(f"time: converted / original {ratios} (not slower, {slack:.0%} slack)")


def _median_ms(times: dict, name: str, part: str, decode: int) -> float:
    """Median of ``name``'s timings of ``part`` (ms); for ``decode_compiled``, per decode step: the median
    full generate less the median short one, over ``decode`` steps. On a loaded CPU that difference can fall
    below the timings' noise, even below 0; the caller then gives no verdict for the part."""
    if part != "decode_compiled":
        return statistics.median(times[(name, part)])
    full, short = (statistics.median(times[(name, f"compiled_{k}")]) for k in ("full", "short"))
    return (full - short) / decode


def _warm_compiled(models: dict, prompt, decode: int, backend: str, mode: str, dev) -> dict:
    """Compile each model's decoding (two warm-up calls of each length: the first compiles, the second runs
    the graphs once more) and count what dynamo made: graphs, graph breaks, compile seconds."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = {"backend": backend, "mode": mode or None, "fullgraph": True}
    for name, model in models.items():
        _setup_compiled(model, backend, mode or None, dev)
        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        for stop in (2, decode + 2, 2, decode + 2):
            _compiled_generate(model, prompt, decode + 2, stop)
        _sync(dev)
        out[name] = {"unique_graphs": counters["stats"]["unique_graphs"] - before,
                     "warmup_s": time.perf_counter() - t0}  # fmt: skip
    out["graph_breaks"] = sum(counters["graph_break"].values())
    out["unique_graphs_after_warmup"] = counters["stats"]["unique_graphs"]
    if out["graph_breaks"]:
        raise RuntimeError(f"graph breaks under fullgraph: {dict(counters['graph_break'])}")
    print(f"time: compiled decoding warmed up: {out}")
    return out


@contextlib.contextmanager
def _no_recompile():
    """Any recompile inside the block raises (a decoding that recompiles per call is a failure)."""
    torch.compiler.set_stance("fail_on_recompile")
    try:
        yield
    finally:
        torch.compiler.set_stance("default")


if __name__ == "__main__":
    main()
