"""Write a synthetic sharded safetensors checkpoint of any size, one tensor at a time (bounded memory).

    python benchmarks/make_checkpoint.py /tmp/7b --preset 7b --tied --dtype bfloat16  # 5.87B params, 11.7 GB
    python benchmarks/make_checkpoint.py /tmp/tinyllama --preset tinyllama       # 1.17B params, 4.36 GiB f32
    python benchmarks/make_checkpoint.py /tmp/m1g --size 1GiB                    # Llama-shaped, ~1 GiB
    python benchmarks/make_checkpoint.py /tmp/g --preset small --gemma --tied    # Gemma-style (1+w) norms
    python benchmarks/make_checkpoint.py /tmp/mx --preset mixtral --dtype bfloat16  # Mixtral-8x7B's shape,
        # 4 layers, the hub's per-expert layout (block_sparse_moe.experts.N.w1/w2/w3.weight): 12.4 GB

The model is a transformers Llama (or, with --gemma, Gemma; with a mixtral preset, Mixtral) built on the meta
device, so its parameter names, shapes and tying are transformers' own; tensors that transformers assembles as
it loads (Mixtral's experts) are written as ``save_pretrained`` writes them (its ``revert_weight_conversion``
on the meta model: one tensor per expert, the hub's layout). Weights are N(0, 0.02) from a fixed seed per
tensor; every norm scale is re-randomized to base + U(-0.5, 0.5) (base 1, or 0 for Gemma's (1+w) norms; norm
biases U(-0.5, 0.5)), because transformers' identity initialization hides fold bugs. Norm parameters are
recognized by their module's class name (a benchmark convenience, not how normswap finds norms).

The tokenizer is SmolLM2's (49152 tokens), read from the GGUF file normswap caches for ``smollm2-135m``
(run ``normswap inspect smollm2-135m`` once to fetch it) or from --tokenizer (a directory or .gguf file).
Shards are filled in parameter order up to --max-shard-size, named as transformers names them, with
``model.safetensors.index.json``; the directory appears with one rename when complete.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import click
import torch

PRESETS = {
    # Llama-2-7B's layer shape with 8 KV heads (grouped-query attention, as Llama-3-8B) and SmolLM2's
    # vocabulary: 5.87B parameters with --tied, 11.7 GB in bfloat16 (the acceptance run of the plain command)
    "7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    # TinyLlama-1.1B's shape with SmolLM2's vocabulary: 1.17B parameters, 4.36 GiB in float32
    "tinyllama": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),
    # narrower layers so that --size reaches 0.5 GiB: 45 MB of float32 weights per layer
    "small": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
    # Mixtral-8x7B's layer shape (8 experts of intermediate 14336, 2 chosen per token) with 4 layers and
    # SmolLM2's vocabulary: 6.2B parameters, 12.4 GB in bfloat16; one layer's experts are 2.8 GB
    "mixtral": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # the same at a quarter of the width and 2 layers: 0.55 GB in bfloat16 (where the peak goes)
    "mixtral-small": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # a few MB, for tests
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
VOCAB = 49152


def load_tokenizer(path: str | None):
    """SmolLM2's tokenizer from ``path`` (a directory or a .gguf file) or normswap's cache."""
    from transformers import AutoTokenizer

    if path is None:
        from normswap.io import cache_dir

        ggufs = sorted((cache_dir() / "smollm2-135m").glob("*.gguf"))
        if not ggufs:
            raise click.ClickException(
                "no cached smollm2-135m; run `normswap inspect smollm2-135m` or pass --tokenizer"
            )
        path = str(ggufs[0])
    p = Path(path)
    if p.is_file():
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def make_config(
    preset: str,
    *,
    layers: int | None,
    vocab: int,
    tied: bool,
    gemma: bool,
    size: int | None,
    dtype: torch.dtype,
):
    """The transformers config; with ``size`` (bytes), the layer count that comes closest to it."""
    from transformers import GemmaConfig, LlamaConfig, MixtralConfig

    shape = dict(PRESETS[preset])
    cls = MixtralConfig if "num_local_experts" in shape else GemmaConfig if gemma else LlamaConfig
    extra = dict(head_dim=shape["hidden_size"] // shape["num_attention_heads"]) if gemma else {}
    common = dict(vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=2048, **extra)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    if size is not None:
        one = cls(**{**shape, "num_hidden_layers": 1}, **common)
        two = cls(**{**shape, "num_hidden_layers": 2}, **common)
        base, per_layer = _nbytes(one, dtype), _nbytes(two, dtype) - _nbytes(one, dtype)
        shape["num_hidden_layers"] = max(1, round((size - (base - per_layer)) / per_layer))
    return cls(**shape, **common)


def _params(config, dtype: torch.dtype):
    """``[(name, shape, module class name)]`` of the tensors ``save_pretrained`` writes (tied ones once;
    parameters that transformers assembles on loading, as the tensors it splits them into), on meta."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    params = dict(model.named_parameters())
    saved = revert_weight_conversion(model, params)
    modules = dict(model.named_modules())
    return [(name, tuple(p.shape), type(modules.get(name.rpartition(".")[0])).__name__)
            for name, p in saved.items()]  # fmt: skip


def _nbytes(config, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for _, shape, _ in _params(config, dtype):
        n = 1
        for s in shape:
            n *= s
        total += n * size
    return total


def _tensor(index: int, shape, module_class: str, name: str, *, seed: int, gemma: bool, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    if "norm" in module_class.lower() and len(shape) == 1:
        base = 0.0 if (gemma or name.endswith("bias")) else 1.0
        return (base + torch.rand(shape, generator=gen) - 0.5).to(dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def write_checkpoint(
    out: Path,
    config,
    tokenizer,
    *,
    dtype: torch.dtype,
    max_shard_size: int,
    seed: int = 0,
    gemma: bool = False,
) -> Path:
    """Write the checkpoint of ``config`` into ``out`` (which must not exist); returns ``out``."""
    from normswap.files import apply_umask
    from normswap.io.shards import ShardWriter, nbytes, write_index

    params = _params(config, dtype)
    shards: list[list[int]] = [[]]
    filled = 0
    for i, (_, shape, _) in enumerate(params):
        size = nbytes(dtype, shape)
        if shards[-1] and filled + size > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(i)
        filled += size
    n = len(shards)
    names = (
        ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        weight_map, total = {}, 0
        for file, members in zip(names, shards, strict=True):
            writer = ShardWriter(built / file, [(params[i][0], dtype, params[i][1]) for i in members])
            for i in members:
                name, shape, cls = params[i]
                writer.write(name, _tensor(i, shape, cls, name, seed=seed, gemma=gemma, dtype=dtype))
                weight_map[name] = file
                total += nbytes(dtype, shape)
            writer.close()
        if n > 1:
            write_index(built, weight_map, total)
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        config.dtype = str(dtype).removeprefix("torch.")
        config.save_pretrained(built)
        if tokenizer is not None:
            tokenizer.save_pretrained(built)
        apply_umask(built)  # mkdtemp makes a private folder
        os.rename(built, out)
    finally:
        shutil.rmtree(built, ignore_errors=True)
    return out


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="small", show_default=True)
@click.option("--size", default=None, help="Target size (2GiB, 500MB, ...): sets the layer count.")
@click.option(
    "--layers", type=click.IntRange(min=1), default=None, help="Layer count (overrides the preset)."
)
@click.option("--vocab", type=click.IntRange(min=2), default=VOCAB, show_default=True)
@click.option("--tied", is_flag=True, help="Tie lm_head to the input embedding.")
@click.option("--gemma", is_flag=True, help="Gemma architecture: (1+w) norms, re-randomized around 0.")
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True
)
@click.option(
    "--max-shard-size", default="2GB", show_default=True, help="Largest shard (accelerate's syntax)."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--tokenizer", "tokenizer_path", default=None, help="Tokenizer directory or .gguf (default: SmolLM2's)."
)
def main(out, preset, size, layers, vocab, tied, gemma, dtype, max_shard_size, seed, tokenizer_path):
    """Write a synthetic checkpoint to OUT (must not exist)."""
    from accelerate.utils import convert_file_size_to_int

    if out.exists():
        raise click.ClickException(f"{out} exists")
    torch_dtype = getattr(torch, dtype)
    config = make_config(
        preset,
        layers=layers,
        vocab=vocab,
        tied=tied,
        gemma=gemma,
        size=convert_file_size_to_int(size) if size else None,
        dtype=torch_dtype,
    )
    tokenizer = load_tokenizer(tokenizer_path)
    if len(tokenizer) > vocab:
        raise click.ClickException(f"the tokenizer has {len(tokenizer)} tokens, more than --vocab {vocab}")
    write_checkpoint(
        out,
        config,
        tokenizer,
        dtype=torch_dtype,
        max_shard_size=convert_file_size_to_int(max_shard_size),
        seed=seed,
        gemma=gemma,
    )
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    click.echo(
        f"{out}: {config.num_hidden_layers} layers, {total / 2**30:.2f} GiB in "
        f"{len(list(out.glob('*.safetensors')))} shard(s)"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
