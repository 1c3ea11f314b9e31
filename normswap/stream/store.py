"""A model larger than memory as the pipeline's store: the conversion with its large weights on disk.

``normswap.pipeline`` runs one pipeline over a store: the model in memory, or ``ShardStore``, a model whose
every large weight is read from its shard as its module runs (``stream.model``: norm parameters resident),
on one device (``--device``: the CPU or a GPU), one module's weights there at a time. Here:

1. the walk (on the check's first ids, ``walk.short_inputs``, as in memory) and the reference run on the
   streamed model; the reference's localization records go to a temporary file (``stream.records``), so
   the memory does not grow with the layer count; a forward that reads a weight outside its module becomes
   one line (``run``), and the memory a step freed is given back before the next (``settle``);
2. ``normswap.convert.convert`` runs with this store's hooks (``normswap.convert.Store``): the plans read a
   released weight's values from its shard (``read``; by rows for a stack of experts, ``read_rows``); an
   untied Parameter is a placeholder read from the tensor it was tied to (``copy``); centering and the
   rotation express each change of a weight on disk as a *transform* (``Streamed.transform``), a function
   of the tensor's values alone applied every time they are read (the same function on the same values
   gives the in-memory bytes; resident norm parameters and biases change at once, as in memory); the fold
   is left as records for the writer (``fold``: ``writes``);
3. ``write``: every output shard written tensor by tensor with the plan applied (``stream.write``,
   ``stream.plan``) into a hidden folder beside the output (``normswap.io.staging.Staging``), in the
   input's shard layout, with its index; every checkpoint tensor, also those the model class does not run
   (``Streamed.skipped``; the final norm then stays unfolded, ``normswap.io.carry``); a rotation's matrices
   in ``normswap.rotate.ROTATION_FILE``. The checked model is the written checkpoint, streamed, its norms
   swapped;
4. ``save``: ``normswap.json``, then the folder verified by a fresh streamed load (``stream.verify``: the
   digest of every tensor as written, the checked model's outputs; the saved rotation matrices against
   those applied); passed (or ``force``): the folder is exchanged with the output in one step; otherwise
   it is removed and the output is left as it was.

Under ``accelerate launch`` (``torch.distributed`` initialized, ``stream.dist``) every process walks and
plans, process r writes the shards r, r+K, ...; process 0 (``main``) holds the output's lock, writes the
index, config, tokenizer and report, runs the reference, the check and the verification and exchanges the
folder with the output.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from pathlib import Path

import torch

from normswap import files, progress
from normswap.convert import Store
from normswap.device import exact_float32
from normswap.errors import NormswapError
from normswap.io import carry, staging
from normswap.io.shards import CheckpointReader
from normswap.stream import dist
from normswap.stream.model import StreamedParameter, build, is_released, release_memory, unmap_freed_weights
from normswap.stream.records import DiskRecords
from normswap.stream.source import Source


def _read(target: torch.Tensor) -> torch.Tensor:
    return copy.deepcopy(target) if isinstance(target, StreamedParameter) and is_released(target) else target


class ShardStore(Store):
    """The store of a model streamed from ``source`` (``stream.source.open_source``) on ``device``, into
    ``output`` (replaced only with ``overwrite``; ``normswap.io.staging``); ``choice``
    (``normswap.memory.Choice``) chose streaming (its budget and reason go into the report's ``streamed``
    entry). After ``convert``, ``writes`` is the fold plan the shards are written with (the sites the
    rotation did not fold)."""

    label = " (streamed)"  # said in the stages' lines

    def __init__(self, source: Source, output: Path, device: torch.device | str, *, overwrite: bool = False,
                 choice=None):  # fmt: skip
        unmap_freed_weights()
        self.source, self.info, self.device, self.choice = source, source.info, device, choice
        self.name = source.info.source
        self.out = Path(output).expanduser().resolve()
        self.config, self.tokenizer, self.check_tokenizer = (
            source.config,
            source.tokenizer,
            source.check_tokenizer,
        )
        self.streamed = build(source.config, source.reader, source.dtype, device,
                              trust_remote_code=source.trust_remote_code)  # fmt: skip
        self.model = self.streamed.model
        self.copy = self.streamed.copy
        self.main = dist.is_main()  # only the main process checks and saves
        self.writes = self.converted = self.built = None
        self.written: dict[str, tuple] = {}
        self.write_peak = 0
        self._stage = contextlib.ExitStack()  # the main process's Staging, held from the write to the end
        self._staged: list = []
        self.overwrite = overwrite
        self.inputs = None

    def signal_inputs(self):
        """None: a streamed model is a causal LM, checked on token ids."""
        return None

    def carried(self):
        """The input's other files, and the tensors the class does not run (every checkpoint tensor is
        written)."""
        self.inputs = carry.gather(self.info)
        self.inputs.skipped = self.streamed.skipped
        return self.inputs

    @property
    def manifest(self):
        """The input's ``normswap.json`` (a dict), or None."""
        from normswap.io.save import input_manifest

        return input_manifest(self.info.path)

    def records(self):
        """A mapping for the check's localization records (a few positions at every probe point: O(layers)),
        in a temporary file beside the output."""
        parent = self.out.parent
        return DiskRecords(parent if parent.is_dir() and os.access(parent, os.W_OK) else None, owner=self.out)

    def original(self) -> torch.nn.Module:
        """The original model again, streamed over the input's shards (which the conversion never changes):
        the check's float64 rule runs it (``normswap.check.reload_original``)."""
        source = self.source
        return build(source.config, source.reader, source.dtype, self.device,
                     trust_remote_code=source.trust_remote_code).model  # fmt: skip

    def converting(self) -> str:
        """What the convert stage's line says."""
        return f"folding the norms into {len(self.source.reader.files)} shard(s) as they are written"

    def read(self, name: str) -> torch.Tensor:
        """Parameter ``name`` with its values (read from the checkpoint when released)."""
        return _read(self.streamed.model.get_parameter(name))

    def read_rows(self, name: str) -> torch.Tensor:
        """As ``read``, but a parameter read by rows as it is (``fold.input_peaks`` reads it one expert at
        a time)."""
        p = self.streamed.model.get_parameter(name)
        return p if isinstance(p, StreamedParameter) and p.by_rows() else _read(p)

    def run(self, step):
        """``step()``; a forward that reads a streamed weight outside its module becomes one clear line.

        Raises:
            NormswapError: such a read (a ``RuntimeError`` about a storage of size 0).
        """
        try:
            return step()
        except RuntimeError as error:
            if "storage" in str(error) and "size 0" in str(error):
                raise NormswapError(
                    f"{self.name}: cannot be streamed: a weight is read outside the module that holds it "
                    f"({str(error).splitlines()[0]})"
                ) from error
            raise

    def settle(self) -> None:
        release_memory()

    def note(self, step: str) -> None:
        progress.note(f"{step} (streamed) ...")

    @exact_float32()
    def center(self, model, walk, inputs, *, untie: bool, add_biases: bool, recorded=None):
        """``normswap.center.center``: the same plan and arithmetic, each change of a streamed weight a
        transform (``prepare``'s ``defer``)."""
        from normswap.center import commit, plan_centering, prepare
        from normswap.center.inputs import describe

        streamed = self.streamed

        def defer(target: torch.Tensor, op):
            if not isinstance(target, StreamedParameter):
                return None  # a tensor the conversion made (in memory): changed at once
            return lambda: streamed.transform(target, op)

        plan = plan_centering(model, walk, inputs, untie=untie, add_biases=add_biases, recorded=recorded)
        if plan.result.note is None:
            actions = prepare(model, plan, copy=streamed.copy, defer=defer, read=_read)
            plan.result.inputs = describe(model, plan)  # as in memory: before the commit
            commit(model, walk, plan, actions)
        return plan.result

    def fold_and_rotate(self, model, plan, sites, folding, kind: str, seed: int, matrices=None):
        """``normswap.rotate.fold_and_rotate``: the same changes (``rotate.plan_changes``) and float64
        arithmetic per tensor, each weight on disk changed as it is read (a resident one at once).

        Raises:
            normswap.rotate.RotationError: a resident tensor would leave its dtype's range (nothing changed);
                a weight on disk raises it as it is written (``stream.plan.make_tensor``), in one line.
        """
        from normswap.rotate import fold_and_rotate

        streamed = self.streamed

        def defer(target: torch.Tensor, op):
            if not (isinstance(target, StreamedParameter) and is_released(target)):
                return None  # resident (a norm scale, a bias) or made by the conversion: changed at once
            return lambda: streamed.transform(target, op)

        return fold_and_rotate(model, plan, sites, folding, kind, seed, defer=defer, read=_read,
                               matrices=matrices)  # fmt: skip

    def fold(self, model, walk, folding, scales, skip) -> int:
        """Keep the plan of the sites to fold as the shards are written (``writes``: ``folding``'s sites but
        ``skip``), each marked folded; no affine site is folded (a streamed model is a causal LM)."""
        self.writes = dataclasses.replace(folding, sites=[s for s in folding.sites if s.name not in skip])
        for site in folding.sites:
            site.act("fold", folded=True)
        return 0

    @contextlib.contextmanager
    def writing(self):
        """Around the write, the check and the save: a writer's error (``OSError``, ``SafetensorError``, ...)
        becomes one line naming the output; every process waits for the others at the end, and the main one
        then removes the hidden folder unless it was exchanged with the output."""
        try:
            yield
        except NormswapError:
            raise
        except Exception as error:  # any writer's exception type
            raise files.write_error(self.out, error) from error
        finally:
            dist.barrier()
            if self.main:
                self._stage.close()

    def write(self, report):
        """Write the converted checkpoint into a hidden folder beside the output (this process's share of the
        shards, ``stream.write``), and on the main process the files beside them and the rotation's
        matrices; returns the model to check: the written checkpoint, streamed, its norms swapped (None on
        another process). ``report`` (``ConvertReport``) gets ``norms_swapped``."""
        from normswap.stream.plan import tensor_plans
        from normswap.stream.write import write_metadata, write_shards
        from normswap.swap import swap_norms

        source = self.source
        plans = tensor_plans(self.streamed, self.writes, source.dtype)
        self.streamed.close()  # holds only the 1-D parameters from here on
        release_memory()

        def make() -> Path:  # main process: the output's lock and the hidden folder beside it
            self._staged.append(
                self._stage.enter_context(staging.Staging(self.out, overwrite=self.overwrite))
            )
            return self._staged[0].path

        self.built = built = dist.shared_folder(make)
        mine = dist.my_share(source.reader.files)
        written: dict[str, tuple] = {}
        # the most bytes of made tensors this process held at once
        self.write_peak = dist.all_ok(lambda: write_shards(source.reader, plans, built, mine, written,
                                                           self.device))  # fmt: skip
        self.written = dist.merged(written)
        if not self.main:
            return None
        write_metadata(source, plans, built, self.config, self.inputs)
        if report.rotation is not None:  # the matrices applied, as the in-memory save writes them
            from normswap.io.save import write_extra_tensors
            from normswap.rotate import ROTATION_FILE

            write_extra_tensors(built, {ROTATION_FILE: report.rotation.saved_tensors()})
        release_memory()
        self.converted = build(self.config, CheckpointReader(built), source.dtype, self.device,
                               trust_remote_code=source.trust_remote_code)  # fmt: skip
        report.norms_swapped = swap_norms(self.converted.model, report.sites)
        return self.converted.model

    def save(self, data: dict, passed: bool, *, input_ids, extra_files: dict, rotation, force: bool, stages):
        """``normswap.json`` (``data``, with the ``streamed`` entry added), the proved maps
        (``extra_files``), then, when ``passed`` (or ``force``), the folder verified by a fresh streamed
        load (``data["verify"]``) and exchanged with the output if that passed (or ``force``)."""
        from normswap.io.staging import MANIFEST
        from normswap.stream.verify import record, verify_streamed

        source, built, out = self.source, self.built, self.out
        for name, text in extra_files.items():
            (built / name).parent.mkdir(parents=True, exist_ok=True)
            files.write_text(built / name, text)
        expected = None
        if passed or force:  # what the saved copy must reproduce
            expected = self.run(lambda: record(self.converted.model, input_ids, self.written, source.dtype))
        self.converted.close()
        peak = max(self.streamed.peak, self.converted.peak, self.write_peak)
        self.converted = self.written = None
        choice = self.choice
        data["streamed"] = {
            "shards": len(source.reader.files), "processes": dist.world_size(), "device": str(self.device),
            "budget": choice.budget if choice is not None else None, "peak_weight_bytes": peak,
            **device_peak(self.device), "choice": choice.to_dict() if choice is not None else None,
        }  # fmt: skip
        if rotation is not None:  # the rotation's float64 matrices and one tensor's temporaries
            from normswap.rotate.apply import rotation_bytes

            largest = max((t.nbytes // t.dtype.itemsize for t in source.reader.tensors.values()), default=0)
            heads = rotation.matrices.get("H")
            data["streamed"]["rotation_bytes"] = rotation_bytes(
                rotation.Q.shape[0], heads.size if heads is not None else 0, tensor_numel=largest,
                tensor_bytes=largest * source.dtype.itemsize,
            )  # fmt: skip
        stages.start("save", f"{out} (the shards are written; its manifest, then the exchange)")
        files.write_json(built / MANIFEST, data)
        staging.at_stage("written")
        if passed or force:  # verified where it was written; it replaces the output only then
            release_memory()
            stages.start("verify", f"{out} by a fresh load (streamed)")
            verified = self.run(
                lambda: verify_streamed(built, expected, source.trust_remote_code, self.device)
            )
            if rotation is not None:
                from normswap.rotate import check_saved

                verified.failures += check_saved(built, rotation)
                verified.passed = not verified.failures
            stages.stop()
            verified.path = str(out)
            data["verify"] = verified.to_dict()
            data["timings"] = dict(stages.timings)
            staging.at_stage("verified")
            if verified.passed or force:
                stages.start("save", f"{out}: replacing it by the verified checkpoint")
                stages.stop()
                data["timings"] = dict(stages.timings)
                self._staged[0].commit(data | {"saved": True})
        stages.stop()
        data["timings"] = dict(stages.timings)

    def agree(self, passed: bool) -> bool:
        """The main process's verdict, on every process."""
        return dist.broadcast(passed)


def device_peak(device: torch.device | str) -> dict[str, int]:
    """``{"peak_device_bytes": N}``: the most memory torch allocated on a CUDA ``device`` so far; ``{}``
    elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"peak_device_bytes": int(torch.cuda.max_memory_allocated(device))}
