"""TorchRec's DLRM / DLRM-DCN as a library: table sets and presets (:mod:`.tables`), synthetic
and Criteo batches (:mod:`.data`), checkpoints (:mod:`.checkpoint`), the model, its planner and
its sharding (:mod:`.model`), and one training run over validated options (:mod:`.options`,
:mod:`.run`). ``examples/dlrm/train.py`` is the command line over it; the benchmarks and the
tests build their models with it.

``tables`` and ``options`` need no torch (a launcher validates its input cheaply); the other
modules import torch and TorchRec.
"""
