"""Tiny random-weight models of many architectures, and the coverage table that proves the walker on them.

Every zoo model is built from its Hugging Face config at a tiny size (vocab 128, hidden 64, intermediate 128,
2 layers, 4 heads, 2 KV heads, head_dim 16 unless the architecture needs otherwise), in float32 and eval
mode, from a fixed seed. transformers initializes norm weights at their identity (1, or 0 for ``(1 + w)``
norms) and biases at 0, which hides every folding bug, so every parameter its initialization left constant
is re-randomized to that constant plus U(-0.5, 0.5) (``randomize_constants``), and so are BatchNorm running
statistics. This works by parameter, never through normswap's own walk: a norm the walk misses still
computes a non-identity map, and the conversion must keep it.

The per-architecture config overrides below are test fixtures (how to make each config tiny and valid), not
knowledge the walker uses.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.device import exact_float32

BASE_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)

_DROP = object()  # marks a BASE_CONFIG key an architecture must not receive

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# DeepSeek V2/V3: routed + shared experts and multi-head latent attention (q_a/kv_a norms)
_MLA = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    head_dim=8,
    num_key_value_heads=4,
)

# Config keys each architecture needs on top of BASE_CONFIG to be tiny and valid.
_ARCH_DEFAULTS: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_MOE, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(_MOE),
    "gpt2": dict(n_inner=128, n_positions=64),
    "gpt_bigcode": dict(n_inner=128, n_positions=64),
    "gptj": dict(n_inner=128, rotary_dim=8),
    "codegen": dict(n_inner=128, rotary_dim=8, n_ctx=64),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "bloom": dict(n_head=4),
    "falcon": dict(num_kv_heads=2, ffn_hidden_size=128, head_dim=_DROP),  # head_dim is derived
    "phi3": dict(pad_token_id=0),
    "smollm3": dict(pad_token_id=0),
    "glm": dict(pad_token_id=0),
    "glm4": dict(pad_token_id=0),
    "falcon_h1": dict(
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
        mamba_rms_norm=True,
    ),
    "jamba": dict(
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_expand=2,
    ),
    "gemma3n_text": dict(
        num_kv_shared_layers=0,
        altup_num_inputs=2,
        laurel_rank=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        intermediate_size=[128, 128],
        activation_sparsity_pattern=[0.0, 0.0],
    ),
    "deepseek_v3": _MLA,
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, sliding_window=8),
    "olmoe": dict(_MOE, intermediate_size=32),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    ),
    "switch_transformers": dict(
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        num_experts=4,
        expert_capacity=8,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
    ),
    "deepseek_v2": _MLA,
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=64, expansion_ratio=2),
    "qwen3_next": dict(
        _MOE,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        shared_expert_intermediate_size=32,
    ),
    "t5": dict(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4),
    "bert": dict(max_position_embeddings=64),
    "mobilebert": dict(
        embedding_size=32,
        intra_bottleneck_size=32,
        true_hidden_size=32,
        num_feedforward_networks=2,
        intermediate_size=64,
        num_key_value_heads=_DROP,
        head_dim=_DROP,
    ),
    # a conformer speech encoder: its conv modules hold BatchNorm1d over (B, C, T)
    "wav2vec2-conformer": dict(
        vocab_size=32,
        conv_dim=(32, 32),
        conv_stride=(5, 4),
        conv_kernel=(10, 8),
        num_feat_extract_layers=2,
        conv_depthwise_kernel_size=7,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        num_key_value_heads=_DROP,
        head_dim=_DROP,
        max_position_embeddings=_DROP,
    ),
    # convolutional vision models: BatchNorm2d after bias-free (ResNet) and biased (SwiftFormer) convolutions
    "resnet": dict(
        embedding_size=8,
        hidden_sizes=[8, 16, 24, 32],
        depths=[1, 1, 1, 1],
        image_size=32,
        **{k: _DROP for k in BASE_CONFIG},
    ),
    "swiftformer": dict(
        depths=[1, 1, 1, 1],
        embed_dims=[8, 16, 24, 32],
        mlp_ratio=2,
        image_size=32,
        **{k: _DROP for k in BASE_CONFIG},
    ),
}


@dataclass(frozen=True)
class ZooEntry:
    """One row of the coverage table: a name, the config ``model_type`` and config overrides."""

    name: str
    model_type: str
    overrides: dict = field(default_factory=dict)


ZOO: list[ZooEntry] = [
    ZooEntry("llama", "llama"),
    ZooEntry("llama-tied", "llama", dict(tie_word_embeddings=True)),
    ZooEntry("mistral", "mistral"),
    ZooEntry("mixtral", "mixtral"),
    ZooEntry("qwen2", "qwen2"),
    ZooEntry("qwen2_moe", "qwen2_moe"),
    ZooEntry("qwen3", "qwen3", dict(tie_word_embeddings=True)),
    ZooEntry("qwen3_moe", "qwen3_moe"),
    ZooEntry("gemma", "gemma", dict(tie_word_embeddings=False)),
    ZooEntry("gemma-tied", "gemma", dict(tie_word_embeddings=True)),
    ZooEntry("gemma2", "gemma2", dict(tie_word_embeddings=False)),
    ZooEntry("gemma3_text", "gemma3_text"),
    ZooEntry("phi", "phi"),
    ZooEntry("phi3", "phi3"),
    ZooEntry("gpt2", "gpt2"),
    ZooEntry("gpt_neox-parallel", "gpt_neox", dict(use_parallel_residual=True)),
    ZooEntry("gpt_neox-sequential", "gpt_neox", dict(use_parallel_residual=False)),
    ZooEntry("gptj", "gptj"),
    ZooEntry("falcon-classic", "falcon", dict(new_decoder_architecture=False, multi_query=True)),
    ZooEntry("falcon-new", "falcon", dict(new_decoder_architecture=True)),
    ZooEntry("opt", "opt"),
    ZooEntry("bloom", "bloom"),
    ZooEntry("olmo", "olmo"),
    ZooEntry("olmo2", "olmo2"),
    ZooEntry("cohere", "cohere", dict(use_qk_norm=False)),
    ZooEntry("cohere-qknorm", "cohere", dict(use_qk_norm=True)),
    ZooEntry("stablelm", "stablelm"),
    ZooEntry("starcoder2", "starcoder2"),
    ZooEntry("granite", "granite"),
    ZooEntry("deepseek_v3", "deepseek_v3"),
    ZooEntry("gpt_bigcode", "gpt_bigcode"),
    ZooEntry("codegen", "codegen"),
    ZooEntry("smollm3", "smollm3"),
    ZooEntry("glm", "glm"),
    ZooEntry("exaone4", "exaone4"),
    ZooEntry("t5", "t5"),
    ZooEntry("gpt_oss", "gpt_oss"),
    ZooEntry("gpt_oss-batched", "gpt_oss", dict(experts_implementation="batched_mm")),
    ZooEntry("mixtral-eager", "mixtral", dict(experts_implementation="eager")),
    ZooEntry("mixtral-batched", "mixtral", dict(experts_implementation="batched_mm")),
    ZooEntry(
        "falcon-rw",
        "falcon",
        dict(bias=True, alibi=True, parallel_attn=False, multi_query=False, num_kv_heads=4),
    ),
    ZooEntry("nemotron", "nemotron"),
    ZooEntry("olmoe", "olmoe"),
    ZooEntry("granitemoe", "granitemoe"),
    ZooEntry("phimoe", "phimoe"),
    ZooEntry("dbrx", "dbrx"),
    # Untied, because its forward reads config.tie_word_embeddings at run time, so untying changes what it
    # computes (tests/test_zoo.py::test_untying_keeps_a_forward_that_reads_the_tie_flag); initializer_factor
    # 0.05 because the untied lm_head is initialized with std 1.0, and logits of size ~40 carry float32
    # rounding of ~2e-5 on their own.
    ZooEntry(
        "switch_transformers", "switch_transformers", dict(tie_word_embeddings=False, initializer_factor=0.05)
    ),
    ZooEntry("deepseek_v2", "deepseek_v2"),
    ZooEntry("persimmon", "persimmon"),
    ZooEntry("mpt", "mpt"),
    ZooEntry("cohere2", "cohere2"),
    ZooEntry("glm4", "glm4"),
    ZooEntry("qwen3_next", "qwen3_next"),
    ZooEntry("lfm2", "lfm2"),
    ZooEntry("helium", "helium"),
    ZooEntry("ernie4_5", "ernie4_5"),
    ZooEntry("seed_oss", "seed_oss"),
    ZooEntry("olmo3", "olmo3"),
    ZooEntry("hunyuan_v1_dense", "hunyuan_v1_dense"),
    ZooEntry("apertus", "apertus"),
    ZooEntry("arcee", "arcee"),
    ZooEntry("gemma3n_text", "gemma3n_text"),
    ZooEntry("falcon_h1", "falcon_h1"),
    ZooEntry("jamba", "jamba"),
    ZooEntry("bert", "bert"),
    ZooEntry("mobilebert", "mobilebert"),
    ZooEntry("wav2vec2_conformer", "wav2vec2-conformer"),
    ZooEntry("resnet", "resnet"),
    ZooEntry("swiftformer", "swiftformer"),
    ZooEntry("custom", "custom"),
]

# model types loaded headless (``AutoModel``) and compared on their last hidden state: encoders without an
# LM head, speech and vision backbones
_HEADLESS = {"bert", "mobilebert", "wav2vec2-conformer", "resnet", "swiftformer"}


def _auto_class(config):
    import transformers

    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    if config.model_type in _HEADLESS:  # the encoder itself, compared on last_hidden_state
        return transformers.AutoModel
    return transformers.AutoModelForCausalLM


def tiny_config(model_type: str, **config_overrides):
    """The tiny ``PretrainedConfig`` for ``model_type`` (``BASE_CONFIG`` + the architecture's needs +
    ``config_overrides``).

    Raises:
        ValueError: ``model_type`` is not an architecture transformers knows.
    """
    from transformers import AutoConfig

    values = {**BASE_CONFIG, **_ARCH_DEFAULTS.get(model_type, {}), **config_overrides}
    values = {k: v for k, v in values.items() if v is not _DROP}
    return AutoConfig.for_model(model_type, **values)


# running statistics torch's BatchNorm/InstanceNorm (``_NormBase``) keep as buffers, and their initial values
_RUNNING_STATS = {"running_mean": 0.0, "running_var": 1.0}


@torch.no_grad()
def randomize_constants(model: nn.Module, seed: int = 1) -> list[str]:
    """Move every parameter its initialization left constant to that constant plus U(-0.5, 0.5), in place.

    transformers initializes norm scales at 1 (0 for ``(1 + w)`` norms) and norm and linear biases at 0,
    which hides every folding bug. This works by parameter, never through normswap (the code under test):
    a norm normswap's walk misses still computes a non-identity map. Every floating parameter of more than
    one element whose elements are all equal (all ones: a scale; all zeros: a ``(1 + w)`` scale or a bias;
    any other constant: a layer scale) gets ``constant + U(-0.5, 0.5)``, drawn in float64 from a generator
    seeded with ``seed``, in ``named_parameters`` order (tied parameters once), and rounded to the
    parameter's dtype. Parameters that are not constant (projections, embeddings) keep their values.

    Exceptions, by what they are, not by name:

    * single-element parameters: a constant tells nothing there, their initial value is a chosen one
      (xIELU's ``alpha_p``/``alpha_n`` in Apertus), and no norm scale is a scalar in the zoo;
    * buffers are not parameters and keep their values (DeepSeek-V3's ``e_score_correction_bias``,
      Falcon-H1's ``mup_vector``), except the BatchNorm running statistics below.

    Buffers named ``running_mean`` and ``running_var`` (torch's names for a BatchNorm's statistics, ``0``
    and ``1`` at initialization) get ``0 + U(-0.5, 0.5)`` and ``1 + U(-0.5, 0.5)`` where they are still at
    those values: an eval-mode BatchNorm at its initial statistics is almost the identity and hides a wrong
    fold just as a weight of 1 does.

    Args:
        model: any ``nn.Module``; changed in place.
        seed: the generator's seed.

    Returns:
        The names (``named_parameters`` / ``named_buffers`` names) of the tensors it moved, in order.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    moved = []

    def move(name: str, t: torch.Tensor, base: float) -> None:
        noise = torch.rand(t.shape, generator=gen, dtype=torch.float64, device="cpu") - 0.5
        t.copy_((base + noise).to(t.device, t.dtype))
        moved.append(name)

    for name, p in model.named_parameters():
        if p.is_floating_point() and p.numel() > 1:
            first = p.detach().reshape(-1)[0]
            if bool((p == first).all()):
                move(name, p, first.item())
    for name, b in model.named_buffers():
        base = _RUNNING_STATS.get(name.rsplit(".", 1)[-1])
        if base is not None and b.is_floating_point() and bool((b == base).all()):
            move(name, b, base)
    return moved


def tiny_model(model_type: str, seed: int = 0, **config_overrides) -> nn.Module:
    """Build a tiny random model of ``model_type`` in float32 and eval mode, every parameter its
    initialization left constant re-randomized (``randomize_constants``: norm weights and biases, linear
    biases, layer scales; BatchNorm running statistics).

    Args:
        model_type: a transformers ``model_type`` (``"llama"``, ``"gpt2"``, ``"t5"``, ...) or ``"custom"``
            (``CustomLM``, hand-written norms under names that say nothing about norms).
        seed: torch seed for the weights; ``randomize_constants`` uses ``seed + 1``.
        **config_overrides: config values replacing the tiny defaults; ``experts_implementation``
            (``"eager"``, ``"batched_mm"``, ``"grouped_mm"``) is passed to ``from_config`` instead.

    Raises:
        ValueError: ``model_type`` is unknown to transformers (from ``AutoConfig.for_model``).

    Returns:
        The model (``AutoModelForCausalLM``; ``AutoModelForSeq2SeqLM`` for encoder-decoders, ``AutoModel``
        for BERT, MobileBERT and the speech and vision backbones). Its forward takes ``input_ids`` of shape
        ``(batch, seq)``, int64 in ``[0, 128)``, or a waveform / image (``normswap.walk.signal_inputs``).
    """
    torch.manual_seed(seed)
    if model_type == "custom":
        model = CustomLM(**config_overrides)
    else:
        # how the MoE experts run ("eager", "batched_mm", "grouped_mm") is a loading option, not a config key
        options = {k: config_overrides.pop(k) for k in ("experts_implementation",) if k in config_overrides}
        config = tiny_config(model_type, **config_overrides)
        model = _auto_class(config).from_config(config, dtype=torch.float32, **options)
    model = model.float().eval()
    randomize_constants(model, seed + 1)
    return model


# -- a hand-written model: norms under unusual class and parameter names ---------------------------------


class Squash(nn.Module):
    """An RMS norm under another name: ``x / sqrt(mean(x^2) + 1e-6) * gain``."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class Standardize(nn.Module):
    """A LayerNorm written by hand, parameters ``alpha``/``beta``, eps hard-coded to 1e-4."""

    def __init__(self, width: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(width))
        self.beta = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        centered = x - x.mean(-1, keepdim=True)
        return self.alpha * centered / torch.sqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-4) + self.beta


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.pre = Squash(width)
        self.mix = nn.Linear(width, 3 * width, bias=False)  # a fused projection, split afterwards
        self.out = nn.Linear(width, width, bias=False)
        self.pre2 = Standardize(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        a, b, c = self.mix(self.pre(x)).chunk(3, dim=-1)
        x = x + self.out(torch.sigmoid(a) * b + c)
        return x + self.down(torch.nn.functional.gelu(self.up(self.pre2(x))))


class CustomLM(nn.Module):
    """A small language model with no config and no Hugging Face classes: returns logits ``(B, T, vocab)``."""

    def __init__(self, vocab_size: int = 128, width: int = 64, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(_Block(width, hidden) for _ in range(layers))
        self.final = Standardize(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids, **_):
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final(x))


# -- the coverage runner --------------------------------------------------------------------------------


def example_ids(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 3) -> torch.Tensor:
    """``(batch, seq)`` int64 token ids from a fixed seed (not the ids ``convert`` traces with)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen, device="cpu")


def example_inputs(model: nn.Module, seed: int = 3):
    """What the zoo compares a model on: ``example_ids(seed=seed)``, or for a model whose main input is a
    waveform or an image a ``normswap.walk.signal_inputs`` of another seed (and, for a waveform, another
    length) than the conversion traces with."""
    from normswap.walk import signal_inputs

    signal = signal_inputs(model, seed=seed, samples=4800)
    return signal if signal is not None else example_ids(seed=seed).to(next(model.parameters()).device)


@torch.no_grad()
def model_outputs(model: nn.Module, inputs) -> torch.Tensor:
    """The tensor the zoo compares: ``logits`` (``(B, T, vocab)``), or ``last_hidden_state`` for a bare
    encoder, or the model's own output when it returns a tensor. ``inputs``: ``(B, T)`` ids (encoder-decoders
    get them as decoder input too; ``use_cache=False`` where the forward takes it) or
    ``normswap.walk.ExampleInputs``, used as given."""
    from normswap.walk import example_inputs as walk_inputs

    example = walk_inputs(model, inputs)
    out = model(*example.args, **example.kwargs)
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


@dataclass
class ZooResult:
    """One coverage row: what ``convert`` did on a zoo model and how close its outputs stayed.

    ``max_abs_diff`` is the float32 max abs difference of the outputs against the unconverted deepcopy on
    ``example_inputs(model)``; ``top1`` the fraction of positions whose argmax agrees. ``contract`` is the
    check's verdict per returned output (``normswap.check.contract``) on those inputs, ``contract_failures``
    the outputs that changed with no conversion step to explain it.
    """

    name: str
    model_type: str
    found: int = 0
    folded: int = 0
    swapped: int = 0
    swapped_only: list[tuple[str, str]] = field(default_factory=list)
    max_abs_diff: float = float("nan")
    top1: float = float("nan")
    error: str | None = None
    sites: list = field(default_factory=list, repr=False)
    module_names: set[str] = field(default_factory=set, repr=False)
    rotation: Rotated | None = None
    contract: list[dict] = field(default_factory=list, repr=False)
    contract_failures: list[str] = field(default_factory=list)
    models: tuple | None = field(default=None, repr=False)  # (original, converted) when run_entry(keep=True)

    @property
    def passed(self) -> bool:
        return (
            self.error is None
            and self.max_abs_diff <= TOLERANCE
            and self.top1 == 1.0
            and self.found > 0
            and self.swapped == sum(s.swappable for s in self.sites)  # all but norms left in place
            and (self.rotation is None or self.rotation.passed)
            and not self.contract_failures
        )


@dataclass
class Rotated:
    """The rotation part of a coverage row: ``normswap.convert(model, rotate="hadamard", rotate_heads=True)``
    on another copy of the unconverted model (the residual stream alone where the heads are refused).

    ``refused`` holds the one-line ``RotationError`` when the stream cannot be rotated; ``heads`` is the
    heads' refusal when only the stream was rotated (None when the heads were rotated too). ``max_abs_diff``
    compares the rotated model's outputs with the original's; ``reload_diff`` those of a plain transformers
    ``from_pretrained`` of its ``save_pretrained`` copy (NaN for a model that is not a transformers model);
    ``inputs_diff`` those of the rotated model given the original's input embeddings of the ids mapped by the
    rotation's ``inputs_embeds`` map (``Rotation.inputs_embeds``; NaN where the model takes no
    ``inputs_embeds``), and ``inputs_map`` that map's formula (or why there is none).
    """

    refused: str | None = None
    heads: str | None = None
    max_abs_diff: float = float("nan")
    reload_diff: float = float("nan")
    error: str | None = None
    inputs_diff: float = float("nan")
    inputs_map: str | None = None

    @property
    def passed(self) -> bool:
        if self.error is not None:
            return False
        if self.refused is not None:
            return True
        reload_ok = math.isnan(self.reload_diff) or self.reload_diff <= TOLERANCE
        inputs_ok = math.isnan(self.inputs_diff) or self.inputs_diff <= TOLERANCE
        return self.max_abs_diff <= TOLERANCE and reload_ok and inputs_ok


# float32 folds are exact up to rounding: about 1e-6 on these tiny models; every wrong fold seen in the
# field was off by 4e-3 or more (shared/cases/README.md).
TOLERANCE = 1e-5


def _error_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


@torch.no_grad()
def _inputs_embeds_diff(reference: nn.Module, model: nn.Module, rotation, ids, before) -> tuple[str, float]:
    """``(the map's formula, max abs difference of the outputs)``: ``model`` (rotated) given the map of
    ``reference``'s input embeddings of ``ids``, against ``before``; NaN where the model takes no
    ``inputs_embeds`` (no input table, inputs other than ids)."""
    from normswap.walk import accepts

    inputs = rotation.inputs or {}
    table = reference.get_input_embeddings() if hasattr(reference, "get_input_embeddings") else None
    if not isinstance(ids, torch.Tensor) or table is None or not accepts(model, "inputs_embeds"):
        return inputs.get("map") or inputs.get("inputs_embeds"), float("nan")
    if inputs.get("kind") != "map":
        return f"no map: {inputs.get('inputs_embeds')}", float("inf")
    kwargs = {"inputs_embeds": rotation.inputs_embeds(table(ids))}
    if accepts(model, "use_cache"):
        kwargs["use_cache"] = False
    out = model(**kwargs)
    value = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    value = value if value is not None else out.last_hidden_state
    return inputs["map"], (value - before).abs().max().item()


@exact_float32()
def run_rotation(reference: nn.Module, ids: torch.Tensor, before: torch.Tensor) -> Rotated:
    """Rotate a copy of ``reference`` (stream and heads, or the stream alone where the heads are refused),
    compare its outputs with ``before`` and, for a transformers model, those of a plain reload."""
    import tempfile

    from normswap.convert import convert
    from normswap.rotate import RotationError
    from normswap.rotate.heads import HeadRotationError

    result = Rotated()
    try:
        model = copy.deepcopy(reference)
        try:
            report = convert(model, rotate="hadamard", rotate_heads=True)
        except HeadRotationError as error:
            result.heads = str(error)
            model = copy.deepcopy(reference)
            report = convert(model, rotate="hadamard")
        result.max_abs_diff = (model_outputs(model, ids) - before).abs().max().item()
        result.inputs_map, result.inputs_diff = _inputs_embeds_diff(
            reference, model, report.rotation, ids, before
        )
        if hasattr(model, "save_pretrained"):
            with tempfile.TemporaryDirectory() as folder:
                model.save_pretrained(folder)
                fresh = type(reference).from_pretrained(folder, dtype=torch.float32).to(ids.device).eval()
                result.reload_diff = (model_outputs(fresh, ids) - before).abs().max().item()
    except RotationError as error:
        result.refused = str(error)
    except Exception as error:  # noqa: BLE001 - a row records the failure instead of stopping the table
        result.error = _error_line(error)
    return result


@exact_float32()
def run_entry(
    entry: ZooEntry, device: str | torch.device = "cpu", rotate: bool = True, keep: bool = False
) -> ZooResult:
    """Build ``entry``'s tiny model (on the CPU, then moved to ``device``), convert it in place, compare with
    the unconverted copy (logits, and every returned output through the check's contract); with ``rotate``,
    also ``run_rotation`` on another copy; float32 throughout, TF32 off. ``keep``: the result holds
    ``(original, converted)`` in ``models``."""
    from normswap.check import compare, keep_original, reference_outputs
    from normswap.convert import convert, stream_transform

    result = ZooResult(entry.name, entry.model_type)
    try:
        model = tiny_model(entry.model_type, **entry.overrides).to(device)
        reference = copy.deepcopy(model)
        ids = example_inputs(model)
        before = model_outputs(reference, ids)
        if rotate:
            result.rotation = run_rotation(reference, ids, before)
        recorded = reference_outputs(model, ids, rerun=keep_original(reference))
        report = convert(model)
        after = model_outputs(model, ids)
        checked = compare(recorded, model, ids, sites=report.sites, transform=stream_transform(report))
    except Exception as error:  # noqa: BLE001 - a row records the failure instead of stopping the table
        result.error = _error_line(error)
        return result
    result.found, result.folded, result.swapped = (
        report.norms_found,
        report.norms_folded,
        report.norms_swapped,
    )
    result.sites = report.sites
    result.module_names = {name for name, _ in model.named_modules() if name}
    result.swapped_only = [(s.name, s.reason or "") for s in report.sites if not s.folded]
    result.max_abs_diff = (before - after).abs().max().item()
    result.top1 = (before.argmax(-1) == after.argmax(-1)).double().mean().item()
    result.contract = checked.contract
    result.models = (reference, model) if keep else None
    result.contract_failures = [f for f in checked.failures if "no conversion step explains it" in f]
    return result


def run_zoo(
    entries: list[ZooEntry] | None = None, progress=None, device="cpu", rotate: bool = True
) -> list[ZooResult]:
    """``run_entry`` over ``entries`` (default ``ZOO``) on ``device``; ``progress(result)`` is called after
    each row."""
    results = []
    for entry in ZOO if entries is None else entries:
        results.append(run_entry(entry, device, rotate))
        if progress is not None:
            progress(results[-1])
    return results


def _pattern(name: str) -> str:
    """``model.layers.3.self_attn.q_norm`` -> ``model.layers.*.self_attn.q_norm`` (groups repeated layers)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _swapped_only(result: ZooResult) -> str:
    groups: dict[tuple[str, str], int] = {}
    for name, reason in result.swapped_only:
        key = (_pattern(name), _pattern(reason))
        groups[key] = groups.get(key, 0) + 1
    return "<br>".join(
        f"{count} x `{name}`: {reason}" if count > 1 else f"`{name}`: {reason}"
        for (name, reason), count in groups.items()
    )


def magnitude_bound(x: float) -> str:
    """A power of ten above ``2 * x``, at least 1e-6: ``2.4e-07`` -> ``"< 1e-6"``, ``9.5e-07`` -> ``< 1e-5``.

    The table shows this bound rather than the digits: the last digits of a float32 difference depend on
    the CPU's kernels (vector width, summation order). The factor 2 keeps each value at least a factor 2
    below the bound it shows, and values under 5e-7 all show ``< 1e-6``, so a value that moves by tens of
    percent on another CPU keeps its bound and the tracked docs/COVERAGE.md stays the same file
    (``"0"`` for an exact 0).
    """
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"< 1e{max(-6, math.floor(math.log10(2 * x)) + 1)}"


def _rotation_cell(r: ZooResult) -> str:
    """``exact (stream + heads), < 1e-6, reload < 1e-6`` or ``refused: <one line>``."""
    rot = r.rotation
    if rot is None:
        return ""
    if rot.error is not None:
        return f"**error**: {rot.error}"
    if rot.refused is not None:
        return f"refused: {rot.refused}"
    what = "stream + heads" if rot.heads is None else "stream"
    text = f"{'exact' if rot.passed else '**FAILED**'} ({what}), {magnitude_bound(rot.max_abs_diff)}"
    if not math.isnan(rot.reload_diff):
        text += f", reload {magnitude_bound(rot.reload_diff)}"
    if rot.heads is not None:
        text += f"; heads refused ({rot.heads.removeprefix('cannot rotate the attention heads in ')})"
    return text


def coverage_markdown(results: list[ZooResult]) -> str:
    """The coverage table (docs/COVERAGE.md) as Markdown."""
    import transformers

    passed = sum(r.passed for r in results)
    lines = [
        "# Coverage: the walker on a zoo of architectures",
        "",
        "Generated by `normswap zoo --output docs/COVERAGE.md` (normswap/zoo.py); asserted row by row in",
        "tests/test_zoo.py. Do not edit by hand.",
        "",
        f"Each row is a tiny random model built from its transformers {transformers.__version__} config",
        "(vocab 128, hidden 64, 2 layers; float32) with every parameter its initialization left constant",
        "(norm weights and biases, linear biases, layer scales) and every BatchNorm running statistic",
        "re-randomized by parameter, not through normswap (constant + U(-0.5, 0.5)), converted in place by",
        "`normswap.convert(model)` (fold + swap), and",
        "compared with its unconverted deepcopy on 2 x 16 token ids the conversion did not trace with",
        "(speech and vision rows: a random waveform or image of another seed). BatchNorm and affine-only",
        "norms (`batchnorm`, `affine`) are folded into a neighbouring linear map or convolution where exact,",
        "never swapped; the `kinds` column counts the sites of each kind.",
        f"Passed: max abs logit difference <= {TOLERANCE:g}, top-1 agreement 100%, every RMSNorm and",
        "LayerNorm swapped (but those called with another input, which are left in place).",
        "Rotation: another copy converted with",
        '`normswap.convert(model, rotate="hadamard", rotate_heads=True)` (the residual stream and each',
        "attention head rotated; the stream alone where the heads are refused), compared the same way and",
        f"after a plain transformers reload of its `save_pretrained` copy (<= {TOLERANCE:g}), or refused in",
        "one line (docs/ROTATION.md).",
        "The difference is shown as a power of ten at least twice its value (its digits vary between CPUs).",
        "`custom` is `normswap.zoo.CustomLM`: hand-written norms named `Squash`/`Standardize` with",
        "parameters `gain`, `alpha`, `beta`, no config, no transformers classes.",
        "",
        f"**{passed} / {len(results)} passed.**",
        "",
        "| architecture | model_type | norms | kinds | folded | swapped | max abs diff | top-1 | passed "
        "| not folded (why) | rotation |",
        "|---|---|---:|---|---:|---:|---:|---:|---|---|---|",
    ]
    for r in results:
        why = f"error: {r.error}" if r.error else _swapped_only(r)
        diff = magnitude_bound(r.max_abs_diff)
        kinds = {}
        for site in r.sites:
            kinds[site.kind] = kinds.get(site.kind, 0) + 1
        kinds_text = ", ".join(f"{count} {kind}" for kind, count in kinds.items()) or "-"
        lines.append(
            f"| {r.name} | {r.model_type} | {r.found} | {kinds_text} | {r.folded} | {r.swapped} | {diff} | "
            f"{r.top1:.0%} | {'yes' if r.passed else '**no**'} | {why.replace('|', '/')} | "
            f"{_rotation_cell(r).replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"
