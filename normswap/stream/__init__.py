"""Conversion of models larger than memory: weights streamed from safetensors shards (docs/STREAMING.md;
the shards are read and written by ``normswap.io.shards``).

* ``model``: a model whose large weights are read from disk as each module runs;
* ``plan``: the fold plan as per-tensor operations;
* ``convert``: the streamed pipeline behind ``normswap convert --max-memory``.
"""
