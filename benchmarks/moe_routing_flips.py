"""How many tokens a folded MoE router sends to other experts than the float32 original does.

    python benchmarks/moe_routing_flips.py CHECKPOINT [--layer 0]

The checkpoint is streamed (``normswap.stream.model.build``) on the check's 512 ids and stopped at layer
LAYER's router (``model.layers.L.mlp.gate``): its top-k choice in the checkpoint's dtype and in float32
(``normswap.check.core.upcast``), and the folded router's, made from the same weights as the fold makes it
(the norm's weight multiplied into the router weight along its input axis in float64, rounded once:
``normswap.fold.scale_axis_``; the router reads the weight-free norm of the same residual stream). Prints how
many tokens change their set of experts against float32, and how many sit on near-ties (2nd and 3rd logit
within 0.01). The residual stream is the original's in both (the folded attention before it is not run).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Stop(Exception):
    pass


def _route(model, ids, layer: int) -> dict:
    got = {}
    norm = model.get_submodule(f"model.layers.{layer}.post_attention_layernorm")
    gate = model.get_submodule(f"model.layers.{layer}.mlp.gate")

    def before_norm(module, args):
        got["h"] = args[0].clone()

    def after_gate(module, args, out):
        got["logits"], got["index"], got["W"] = out[0].float().clone(), out[-1].clone(), module.weight.clone()
        raise _Stop

    handles = [norm.register_forward_pre_hook(before_norm), gate.register_forward_hook(after_gate)]
    try:
        with torch.no_grad():
            model(ids)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    got["w"], got["eps"] = norm.weight.detach().clone(), norm.variance_epsilon
    return got


@click.command()
@click.argument("checkpoint")
@click.option("--layer", type=int, default=0, show_default=True)
def main(checkpoint, layer):
    """Count the tokens whose experts change (bfloat16 original, folded router) against float32."""
    from normswap.check import default_input_ids
    from normswap.check.core import upcast
    from normswap.fold import scale_axis_
    from normswap.stream.model import build
    from normswap.stream.source import open_source

    source = open_source(checkpoint, "auto")
    ids = default_input_ids(source.tokenizer, 512)
    model = build(source.config, source.reader, source.dtype).model
    own = _route(model, ids, layer)
    with upcast(model):
        f32 = _route(model, ids, layer)
    h = own["h"]
    normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + own["eps"])).to(h.dtype)
    weight = own["W"].clone()
    scale_axis_(weight, own["w"].double(), 1)
    folded = torch.nn.functional.linear(normed, weight).float()
    k = own["index"].shape[-1]
    folded_index = folded.reshape(-1, folded.shape[-1]).topk(k, dim=-1).indices

    def sets(index):
        return [frozenset(row.tolist()) for row in index.reshape(-1, k)]

    ref, mine, fold = sets(f32["index"]), sets(own["index"]), sets(folded_index)
    logits = f32["logits"].reshape(len(ref), -1).sort(dim=-1, descending=True).values
    gap = logits[:, k - 1] - logits[:, k]
    click.echo(f"{len(ref)} tokens, top-{k} of {logits.shape[-1]} experts, layer {layer}")
    click.echo(f"near-ties (logit {k} and {k + 1} within 0.01, float32): {int((gap < 0.01).sum())}, "
               f"median gap {gap.median().item():.3g}")  # fmt: skip
    click.echo(f"experts changed against float32: original {source.dtype} "
               f"{sum(a != b for a, b in zip(ref, mine, strict=True))}, folded router "
               f"{sum(a != b for a, b in zip(ref, fold, strict=True))}; folded vs original "
               f"{sum(a != b for a, b in zip(mine, fold, strict=True))}")  # fmt: skip


if __name__ == "__main__":
    main()
