"""The norms ``normswap.inspect`` finds on every zoo row, written to a JSON file, and the difference of two
such files: what a change to the probe or the walk changed.

    PYTHONPATH=OLD python benchmarks/zoo_sites.py dump before.json   # with the normswap before the change
    PYTHONPATH=NEW python benchmarks/zoo_sites.py dump after.json    # ... and after it
    python benchmarks/zoo_sites.py diff before.json after.json

``dump`` builds each row's tiny model (``normswap.zoo.tiny_model``, float32; ``--dtype bfloat16`` casts it)
and stores ``[site.to_dict() for site in inspect(model)]`` per row (or the row's error), and the warnings
the walk logged (candidates it could not probe). ``diff`` prints every site added, removed or changed (field
by field), then how many rows are identical; it exits 1 when any row differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def dump(out: str, dtype: str) -> None:
    import torch

    from normswap.convert import inspect
    from normswap.zoo import ZOO, tiny_model

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("normswap").addHandler(Collect(logging.WARNING))
    rows: dict[str, object] = {}
    start = time.perf_counter()
    for entry in ZOO:
        warnings.clear()
        try:
            model = tiny_model(entry.model_type, **dict(entry.overrides)).to(getattr(torch, dtype))
            rows[entry.name] = {
                "sites": [s.to_dict() for s in inspect(model)],
                "warnings": sorted(set(warnings)),
            }
        except Exception as error:  # noqa: BLE001 - a row records its failure
            rows[entry.name] = {"error": f"{type(error).__name__}: {error}"}
        print(entry.name, len(rows[entry.name].get("sites", [])), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1, sort_keys=True, default=str)
    print(f"{len(rows)} rows in {time.perf_counter() - start:.0f} s -> {out}")


def diff(before: str, after: str) -> int:
    with open(before) as f:
        a = json.load(f)
    with open(after) as f:
        b = json.load(f)
    same = 0
    for row in sorted(set(a) | set(b)):
        x, y = a.get(row, {}), b.get(row, {})
        if x == y:
            same += 1
            continue
        print(f"{row}:")
        for key in ("error", "warnings"):
            if x.get(key) != y.get(key):
                print(f"  {key}: {x.get(key)} -> {y.get(key)}")
        xs = {s["name"]: s for s in x.get("sites", [])}
        ys = {s["name"]: s for s in y.get("sites", [])}
        for name in sorted(set(xs) | set(ys)):
            if name not in xs:
                print(f"  added {name}: {ys[name]['kind']}, eps {ys[name]['eps']}")
            elif name not in ys:
                print(f"  removed {name}")
            else:
                for field in sorted(set(xs[name]) | set(ys[name])):
                    if xs[name].get(field) != ys[name].get(field):
                        print(f"  {name}.{field}: {xs[name].get(field)} -> {ys[name].get(field)}")
    sites = [sum(len(r.get("sites", [])) for r in rows.values()) for rows in (a, b)]
    print(f"{same} of {len(set(a) | set(b))} rows identical; sites: {sites[0]} before, {sites[1]} after")
    return 0 if same == len(set(a) | set(b)) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump", help="write the site lists of every zoo row")
    dumping.add_argument("out")
    dumping.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    diffing = commands.add_parser("diff", help="compare two dumps")
    diffing.add_argument("before")
    diffing.add_argument("after")
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out, args.dtype)
        return 0
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
