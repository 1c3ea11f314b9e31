"""Conversion of models larger than memory: weights streamed from safetensors shards (docs/STREAMING.md).

* ``shards``: a validating checkpoint reader and a tensor-by-tensor safetensors writer;
* ``model``: a model whose large weights are read from disk as each module runs;
* ``plan``: the fold plan as per-tensor operations;
* ``convert``: the streamed pipeline behind ``normswap convert --max-memory``.
"""
