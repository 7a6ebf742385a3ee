"""measure: everything that measures this machine (kernels, real training steps, guard trials).

* :mod:`.microbench` and :mod:`.kernels`: kernel microbenchmarks and ``sparselift calibrate kernels``;
* :mod:`.probe`: the probe models and the one measurement routine (:func:`~.probe.measure_plan`);
* :mod:`.steps`: the step calibration (``sparselift calibrate steps`` / ``check``);
* :mod:`.attribution`: profiled steps split by sparse-path node kind (:func:`~.attribution.attribute_steps`);
* :mod:`.guard`: the measured guard (a few real steps decide between the model's top plans);
* :mod:`.commands`: the ``sparselift calibrate`` command.

The fits and the profile store these feed are :mod:`torchrec_sparselift.calibration` (pure).
"""
