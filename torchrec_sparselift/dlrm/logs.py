"""What a DLRM run shows: TorchRec's and torch's notices off (errors stay), the package's warnings
on. Needs no torch, so a command quiets the logs before torch's import-time notices."""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_logs"]


def quiet_logs() -> None:
    """Errors only from torch.fx, TorchRec and the root logger; warnings from torchrec_sparselift;
    no UserWarning, DeprecationWarning or FutureWarning."""
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # TorchRec also logs notices on the root logger
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torchrec_sparselift").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
