"""The other direction: who else reads what centering changes (docs/CENTERING.md, "Tied embeddings").

Centering is invisible only to LayerNorms. ``check_readers`` refuses a centered tensor that anything
else reads (an RMSNorm, the model output, an attention score), except views of it that hold no centered
feature (the v slice of a fused qkv whose q/k slices have per-head LayerNorms). ``untie_plan`` finds the
holders of a written parameter whose use is not a write (``lm_head`` tied to the embedding): they must
keep the original values, so each gets its own copy first.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from normswap.center import ops
from normswap.center.errors import refusal
from normswap.center.writers import Write, Writers
from normswap.recording import Key, Recorder


def in_order(rec: Recorder, keys: set[Key]) -> list[Key]:
    """``keys`` in the order the forward made them (parameters first)."""
    return sorted(keys, key=lambda k: rec.nodes[k].order if k in rec.nodes else -1)


def check_readers(
    finder: Writers, cone: set[Key], index, feeds, groups, writes: dict[Key, list[Write]]
) -> None:
    """Every centered tensor must be read only by LayerNorms, sums, and views of itself.

    A view that holds none of the centered features (the v part of a fused qkv whose q part has a
    per-head LayerNorm) may be read by anything.

    Raises:
        CenteringError: naming the first offending read of the forward.
    """
    rec = finder.rec
    centered: dict[Key, torch.Tensor] = {}
    for source, ws in writes.items():
        w = ws[0]
        mask = torch.zeros(rec.tensors[w.param].shape[w.axis], dtype=torch.bool, device="cpu")
        for g in groups.get((w.param, w.axis), [torch.arange(mask.numel(), device="cpu")]):
            mask[g] = True
        centered[source] = mask
    for k in in_order(rec, cone):
        for use in rec.uses.get(k, []):
            if isinstance(use, tuple):
                kind, site = use
                if kind == "output":
                    raise refusal(finder.site_of(k), "the stream it reads is also returned as a model output")
                if finder.kinds.get(site) != "layernorm":
                    raise refusal(
                        finder.site_of(k),
                        f"the stream it reads is also read by {finder.kinds.get(site)} {site}, "
                        "which centering would change (never center what an RMSNorm reads)",
                    )
                continue
            if use.key in cone:
                continue
            if use.out is not None and use.op in ops.PASS and use.operands.get(0) == k:
                seen = ops.replay(use, index[k]).reshape(-1)
                if not any(bool(centered[s][seen].any()) for s in feeds[k]):
                    continue
            raise refusal(
                finder.site_of(k),
                f"the stream it reads is also read by {ops.where(use)}, which centering would change",
            )


def untie_plan(finder: Writers, writes: dict[Key, list[Write]], untie: bool) -> list[tuple[str, str]]:
    """Holders of each written parameter that must keep its original values: each gets its own copy.

    Every use of a written parameter (through views such as ``W.T``) must be one of its writes, or
    happen in a module that holds the parameter under another attribute (``lm_head`` tied to the
    embedding), which is then untied. Any other holder is untied too, so that only the writers see the
    centered values.

    Returns:
        ``(module, attribute)`` pairs to untie, in order.

    Raises:
        CenteringError: a written parameter used by a module that does not hold it, or a holder to untie
            with ``untie`` False.
    """
    rec = finder.rec
    users: dict[str, set[int]] = defaultdict(set)
    first: dict[str, str] = {}
    for ws in writes.values():
        for w in ws:
            if w.table is None:
                users[w.param].add(id(w.user))
                first.setdefault(w.param, finder.site_of(w.source))
    to_untie: list[tuple[str, str]] = []
    for param, writer_nodes in users.items():
        writer_modules, others = set(), []
        stack, seen = [(id(rec.tensors[param]), 0)], set()
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            for use in rec.uses.get(k, []):
                if isinstance(use, tuple):
                    others.append((use[0], use[1] or ""))
                elif id(use) in writer_nodes:
                    writer_modules.add(use.module)
                elif use.key is not None and finder.param_ref(use.key) is not None:
                    stack.append(use.key)  # a view of the parameter
                else:
                    others.append((use.op, use.module))
        holders = [o for o in rec.owners[param] if o[0] not in writer_modules]
        for op, module in others:
            if not any(m == module for m, _ in holders):
                raise refusal(first[param], f"{param} is written into it and also used by {op} in {module}")
        if holders and not untie:
            raise refusal(first[param], f"{param} is written into it and shared with {holders[0][0]} "
                          "(untying disabled)")  # fmt: skip
        to_untie.extend(h for h in holders if h not in to_untie)
    return to_untie
