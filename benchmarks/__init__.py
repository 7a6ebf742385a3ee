"""SparseLift's benchmarks: each one a module run from the repository root as
``python -m benchmarks.<name>`` (under torchrun: ``torchrun ... -m benchmarks.<name>``), built on
:mod:`benchmarks.harness` (worker setup, interleaved rounds, the timed loop, statistics, the
JSON report) and the DLRM model library :mod:`torchrec_sparselift.dlrm`."""
