"""What a command feeds a model, checked before the model runs: token counts, and two models that match.

Used by every command that runs a model on tokens (``convert``, ``check``, ``eval``), so that bad input is
one line and exit code 2 before any forward pass, never an ``IndexError`` from inside the model:

* :func:`position_limit` / :func:`check_positions`: a sequence longer than the model's
  ``max_position_embeddings`` (learned position tables such as GPT-2's ``n_positions`` end there);
* :func:`command_input_ids`: the check's default text ids for ``--tokens``, within that limit;
* :func:`text_ids`: a user's text, refused when it gives fewer tokens than asked for;
* :func:`check_vocabulary`: token ids beyond the model's vocabulary (a tokenizer of another model);
* :func:`check_same_model`: two models that differ in kind, vocabulary or shape.

The messages name the command's options (``what``), as the caller passes them.
"""

from __future__ import annotations

from normswap.errors import NormswapError

DEFAULT_TOKENS = 512
# config fields that two checkpoints of one model share (a conversion changes none of them)
_SAME_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def position_limit(config) -> int | None:
    """The longest token sequence the model takes: its (text) config's ``max_position_embeddings``.

    ``None`` when the config states no limit (GPT-2's ``n_positions`` is read through its alias).
    """
    limit = getattr(_text_config(config), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit >= 2 else None


def check_positions(count: int, what: str, models: dict) -> None:
    """Refuse ``count`` positions beyond the limit of any of ``models`` (name -> config).

    Raises:
        NormswapError: ``"{what} exceeds {name}'s max_position_embeddings ({limit})"``.
    """
    for name, config in models.items():
        limit = position_limit(config)
        if limit is not None and count > limit:
            raise NormswapError(f"{what} exceeds {name}'s max_position_embeddings ({limit})")


def vocabulary_size(config, source="the model") -> int:
    """``config``'s (text) vocabulary size. Raises NormswapError when the config has none."""
    vocab = getattr(_text_config(config), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        raise NormswapError(f"{source}: no tokenizer files and no vocab_size in its config; pass --tokenizer")
    return vocab


def check_vocabulary(largest: int, models: dict, what: str) -> None:
    """Refuse a token id that is not in the vocabulary of any of ``models`` (name -> config): the embedding
    lookup would fail (``IndexError``) or, on a GPU, read out of bounds.

    Args:
        largest: the largest token id the command would feed the models.
        models: name -> config (its text config's ``vocab_size`` counts; a config without one is skipped).
        what: where the ids come from, for the message (``"the tokenizer X on the check text"``).

    Raises:
        NormswapError: ``"{what} gives token id 30521, beyond {name}'s vocabulary (vocab_size 260); ..."``.
    """
    for name, config in models.items():
        vocab = getattr(_text_config(config), "vocab_size", None)
        if isinstance(vocab, int) and largest >= vocab:
            raise NormswapError(
                f"{what} gives token id {largest}, beyond {name}'s vocabulary (vocab_size {vocab}): the "
                "tokenizer does not match the model; use the model's own tokenizer"
            )


def _tokenizer_name(tokenizer, source) -> str:
    name = getattr(tokenizer, "name_or_path", None) or source
    return f"the tokenizer {name}"


def default_tokens(config, reserve: int = 0) -> int:
    """``min(512, limit - reserve)`` (at least 2): the tokens a command takes when not told."""
    limit = position_limit(config)
    return DEFAULT_TOKENS if limit is None else max(2, min(DEFAULT_TOKENS, limit - reserve))


def command_input_ids(source, model_config, tokenizer, tokens: int | None, *, reserve=(0, "")):
    """The check's ``(1, T)`` ids of the default text; over-long requests and bad tokenizers are bad input.

    Args:
        source: the MODEL argument, for messages.
        model_config: the loaded model's config (its position limit applies).
        tokenizer: the model's tokenizer; ``None`` draws the ids from the vocabulary (``vocabulary_ids``,
            fixed seed).
        tokens: ``T``; ``None`` takes ``min(512, limit - reserve)``.
        reserve: ``(N, option)``: N positions needed after the ``T`` tokens (greedy generation), and the
            option that asks for them (named in a refusal).

    Raises:
        NormswapError: ``T + reserve`` beyond the limit; a tokenizer that gives too few or degenerate ids,
            or ids beyond the model's vocabulary (``check_vocabulary``).
    """
    from normswap.check.text import default_input_ids

    extra, option = reserve
    if tokens is None:  # the default: only the reserve was asked for, so only it is named in a refusal
        tokens = default_tokens(model_config, extra)
        what = f"{option} {extra} (plus at least {tokens} tokens to compare)" if extra else f"{tokens} tokens"
    else:
        what = f"--tokens {tokens}" + (f" + {option} {extra}" if extra else "")
    check_positions(tokens + extra, what, {source: model_config})
    if tokenizer is None:  # a checkpoint without tokenizer files: ids drawn from its vocabulary
        from normswap.check.text import VOCABULARY_SEED, vocabulary_ids

        return vocabulary_ids(vocabulary_size(model_config, source), tokens, seed=VOCABULARY_SEED)
    try:
        ids = default_input_ids(tokenizer, tokens)
    except ValueError as error:
        raise NormswapError(f"{source}: {error}") from error
    what = f"{_tokenizer_name(tokenizer, source)} on the check text"
    check_vocabulary(int(ids.max()), {source: model_config}, what)
    return ids


def signal_check_inputs(source, model, tokens: int | None):
    """The check's input for a ``model`` that reads a waveform or an image (``normswap.walk.signal_inputs``,
    torch seed 0) and its report entry, or None for a model that reads token ids.

    Raises:
        NormswapError: ``tokens`` given (``--tokens`` counts token ids; such a model reads none).
    """
    from normswap.walk import signal_inputs

    signal = signal_inputs(model)
    if signal is None:
        return None
    name, value = next(iter(signal.kwargs.items()))
    what = "a waveform" if name == "input_values" else "an image"
    if tokens is not None:
        raise NormswapError(f"--tokens does not apply to {source}: it reads {what} ({name}), not token ids")
    entry = {"source": "random", "input": name, "shape": list(value.shape), "seed": 0,
             "reason": f"{source} reads {what}, not token ids"}  # fmt: skip
    return signal, entry


# Perplexity above which the check text cannot be text the model reads: a trained LM measures 10-100 on text
# of its own tokenizer (on the default check text, SmolLM2-135M 17.5 and Gemma-3-270M 21.5); SmolLM2-135M on
# the same text through all-MiniLM-L6-v2's tokenizer measured 8.3e3, a random-weight model is near its
# vocabulary size.
IMPLAUSIBLE_PPL = 1000.0


def implausible_text(ppl_original: float | None, tokenizer: str | None) -> str | None:
    """A note when the original model's perplexity on the check text is above ``IMPLAUSIBLE_PPL`` (or NaN):
    the ids the tokenizer made mean little to the model. ``None`` otherwise.

    Args:
        ppl_original: the check's ``ppl_original``.
        tokenizer: the ``--tokenizer`` the text went through, or ``None`` for the model's own.
    """
    import math

    if ppl_original is None or not (ppl_original > IMPLAUSIBLE_PPL or math.isnan(ppl_original)):
        return None
    cause = (
        f"--tokenizer {tokenizer} is not its tokenizer: pass the model's own"
        if tokenizer
        else "its tokenizer files may belong to another model (--tokenizer gives the right one), or its "
        "weights are random"
    )
    return (
        f"the original model's perplexity on the check text is {ppl_original:.3g}, far above a trained "
        f"model's on text of its own tokenizer (10-100): the text's ids mean little to it; {cause}"
    )


def text_ids(tokenizer, text: str, tokens: int, *, source, what: str):
    """The first ``tokens`` ids of ``text`` as a ``(1, tokens)`` long tensor.

    Raises:
        NormswapError: the text gives fewer than ``tokens`` ids (named as ``what``, e.g. ``"--tokens"``).
    """
    import torch

    ids = tokenizer(text)["input_ids"]
    if len(ids) < tokens:
        raise NormswapError(
            f"{source} gives only {len(ids)} tokens, fewer than the {tokens} asked for "
            f"(pass a longer text or {what} {max(len(ids), 2)})"
        )
    return torch.tensor([ids[:tokens]], dtype=torch.long, device="cpu")


def _kind(config) -> str:
    return "causal LM" if is_causal_lm(config) else "encoder (no LM head)"


def check_same_model(original: str, a, converted: str, b) -> None:
    """Refuse two configs that cannot be checkpoints of one model: kind, model type, vocabulary, shape.

    Raises:
        NormswapError: one line naming each field that differs, e.g.
            ``"A and B are different models: vocab_size 49152 vs 262144"``.
    """
    differ = []
    kinds = _kind(a), _kind(b)
    if kinds[0] != kinds[1]:
        differ.append(f"{kinds[0]} vs {kinds[1]}")
    ta, tb = _text_config(a), _text_config(b)
    for name in _SAME_FIELDS:
        va, vb = getattr(ta, name, None), getattr(tb, name, None)
        if va is not None and vb is not None and va != vb:
            differ.append(f"{name} {va} vs {vb}")
    if differ:
        raise NormswapError(f"{original} and {converted} are different models: {', '.join(differ)}")


def is_causal_lm(config) -> bool:
    """Whether ``config`` describes a causal LM (load with ``AutoModelForCausalLM``) or not (``AutoModel``).

    With ``config.architectures`` set: true when one of them is a causal-LM class of transformers (or of
    the model's remote code, via ``auto_map``). Without it (GGUF files, hand-made configs): true when the
    ``model_type`` has a causal-LM class and is not an encoder family (one with a masked-LM class),
    unless the config says ``is_decoder``.
    """
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    causal_classes = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal_classes.update(value if isinstance(value, list | tuple) else [value])
    auto_map = getattr(config, "auto_map", None) or {}
    remote_causal = str(auto_map.get("AutoModelForCausalLM", "")).rsplit(".", 1)[-1]
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return any(a in causal_classes or (remote_causal and a == remote_causal) for a in architectures)
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return bool(getattr(config, "is_decoder", False))
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or bool(remote_causal)
