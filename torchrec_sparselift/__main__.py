"""``python -m torchrec_sparselift``: the ``sparselift`` command line."""

from torchrec_sparselift.cli import main

raise SystemExit(main())
