"""``python -m torchrec_sparselift``: the ``sparselift`` command line, also under ``torchrun``
(``torchrun ... -m torchrec_sparselift calibrate steps``). ``calibrate`` goes straight to
:mod:`torchrec_sparselift.measure.commands`, so the kernel calibration runs where torchrec is not
installed (a bare GPU machine)."""

import os
import sys

from torchrec_sparselift.measure.commands import main as calibrate_main


def _run() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["calibrate"]:
        return calibrate_main(argv[1:])
    from torchrec_sparselift.cli import main  # the planner's command line: torchrec

    return main(argv)


code = _run()
if "TORCHELASTIC_RUN_ID" in os.environ:
    # under torchrun: exit without waiting on the collective backend's threads at interpreter shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
