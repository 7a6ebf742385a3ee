"""calibration: fit hardware profiles to measurements, and keep them (pure; no kernels, no
process groups, no timing).

* :mod:`.records`: typed records of what the measuring side (:mod:`torchrec_sparselift.measure`)
  hands over (kernel microbenchmarks, host terms, probe-plan steps);
* :mod:`.nnls`: the one non-negative least-squares solver of every fit;
* :mod:`.kernel_fit`: the kernel microbenchmark fit (:func:`~.kernel_fit.fit_kernel_profile`);
* :mod:`.step_fit`: the step fit from real training steps (:func:`~.step_fit.fit_step_profile`,
  :func:`~.step_fit.fit_probe_plans`), priced by :class:`.pricer.PlanPricer`;
* :mod:`.attribution`: a step's time by sparse-path node kind, measured and predicted;
* :mod:`.store`: machine fingerprints, the profile store and ``hardware="auto"``
  (:func:`~.store.auto_profile`); :mod:`.feedback`: measured-guard trials refit a stored profile.

The base CPU profile ships in ``calibration/data/``.
"""
