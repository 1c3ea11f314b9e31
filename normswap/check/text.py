"""Default evaluation text that exists offline: the topics bundled with Python's ``pydoc``."""

from __future__ import annotations

import torch


def default_text(min_chars: int | None = None) -> str:
    """English prose available on every Python install: the ``pydoc_data.topics`` help texts.

    Topics are joined in sorted key order (deterministic across runs and machines running the same
    Python minor version), separated by blank lines.

    Args:
        min_chars: stop adding topics once the text is at least this long; ``None`` returns all of them
            (about 465,000 characters on Python 3.11).

    Raises:
        RuntimeError: if ``pydoc_data`` is missing from this Python build.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # some distributions strip it
        raise RuntimeError("pydoc_data is missing from this Python; pass your own text or input ids") from exc
    parts: list[str] = []
    length = 0
    for key in sorted(topics):
        parts.append(topics[key].strip())
        length += len(parts[-1]) + 2
        if min_chars is not None and length >= min_chars:
            break
    return "\n\n".join(parts)


def default_input_ids(tokenizer, num_tokens: int = 512) -> torch.LongTensor:
    """Token ids of the first ``num_tokens`` tokens of :func:`default_text`.

    The text is tokenized with the tokenizer's own special tokens (a BOS where the tokenizer adds one) and
    truncated, so the same tokenizer always gives the same ids.

    Args:
        tokenizer: a Hugging Face tokenizer (anything callable as ``tokenizer(text)["input_ids"]``).
        num_tokens: sequence length ``T`` (>= 2).

    Returns:
        ``torch.long`` tensor of shape ``(1, T)`` on the CPU.

    Raises:
        ValueError: if ``num_tokens < 2``, the whole default text gives fewer than ``num_tokens`` tokens, or
            the ids are degenerate (fewer than min(8, T/4) distinct ids: a tokenizer without its vocabulary).
    """
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be at least 2, got {num_tokens}")
    if tokenizer is None:
        raise ValueError("a tokenizer is needed to build the default input ids")
    min_chars = 8 * num_tokens  # English prose runs 3-5 characters per token; retry with all text if short
    for chars in (min_chars, None):
        ids = tokenizer(default_text(chars))["input_ids"]
        if len(ids) >= num_tokens:
            distinct = len(set(ids[:num_tokens]))
            if distinct < min(8, num_tokens // 4):  # even a byte-level tokenizer gives ~25 on English text
                raise ValueError(
                    f"the tokenizer turns {num_tokens} tokens of English text into only {distinct} distinct "
                    "ids (missing tokenizer files?); the check would run on meaningless input"
                )
            return torch.tensor([ids[:num_tokens]], dtype=torch.long, device="cpu")
    raise ValueError(f"the default text gives only {len(ids)} tokens, fewer than the {num_tokens} asked for")


VOCABULARY_SEED = 0


def vocabulary_ids(vocab_size: int, num_tokens: int = 512, seed: int = VOCABULARY_SEED) -> torch.LongTensor:
    """Token ids drawn uniformly from ``[0, vocab_size)`` by ``torch.randint`` with a fixed seed: the check's
    input for a model that comes without a tokenizer (the same ids on every run and machine).

    Args:
        vocab_size: the model's vocabulary size (``config.vocab_size`` of its text config), >= 2.
        num_tokens: sequence length ``T`` (>= 2).
        seed: seed of the ``torch.Generator`` (CPU) that draws them.

    Returns:
        ``torch.long`` tensor of shape ``(1, T)`` on the CPU.

    Raises:
        ValueError: ``vocab_size < 2`` or ``num_tokens < 2``.
    """
    if num_tokens < 2 or vocab_size < 2:
        raise ValueError(f"need num_tokens >= 2 and vocab_size >= 2, got {num_tokens} and {vocab_size}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=generator, dtype=torch.long, device="cpu")
