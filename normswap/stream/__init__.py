"""Conversion of models larger than memory: weights streamed from safetensors shards (docs/STREAMING.md;
the shards are read and written by ``normswap.io.shards``).

* ``source``: a safetensors model opened for streaming (a hub id fetched first);
* ``model``: a model whose large weights are read from disk as each module runs;
* ``store``: ``ShardStore``, the store ``normswap.pipeline`` runs its one pipeline over for such a model;
* ``plan``: the fold plan as per-tensor operations; ``write``: the output shards, tensor by tensor.
"""
