"""``sparselift calibrate {steps,check,kernels}``: the one command for every calibration.

    torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps [--quick]
    sparselift calibrate steps --from-measurements PATH      # refit a saved set, one process
    sparselift calibrate check                                # 0: this machine's profile is current
    sparselift calibrate kernels --out FILE [--quick]         # kernel microbenchmarks -> profile JSON

``steps`` and ``check``: :mod:`torchrec_sparselift.measure.steps`; ``kernels``:
:mod:`torchrec_sparselift.measure.kernels`. The options of all three are declared here; ``steps``
and ``check`` train or read TorchRec models, so their module is imported when they run, and
``kernels`` runs where torch is installed but torchrec is not.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from torchrec_sparselift.measure.kernels import add_kernels_arguments, run_kernels

__all__ = ["build_calibrate_parser", "add_steps_arguments", "add_check_arguments", "add_store_argument", "main"]


def build_calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparselift calibrate",
                                description="Calibrate this machine: fit the hardware profile the planner prices with.")
    sub = p.add_subparsers(dest="what", metavar="{steps,check,kernels}")
    steps = sub.add_parser("steps", help="train the probe plans (under torchrun) and fit the profile to their steps; "
                           "stored per machine, what hardware='auto' reads",
                           description="Fit the hardware profile from real training steps (run under torchrun: "
                           "torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps).")
    add_steps_arguments(steps)
    check = sub.add_parser("check", help="exit 0 if this machine's stored profile is current, else 1",
                           description="Exit 0 if this machine has a stored profile fitted with the current cost "
                           "model's terms on a steady machine, else 1 with the reasons (no torch, no measuring; "
                           "with --link, under torchrun, also the link this job sees).")
    add_check_arguments(check)
    kernels = sub.add_parser("kernels", help="measure kernels and collectives, fit a profile JSON",
                             description="Measure this machine's kernels (and collectives under torchrun) and fit a "
                             "hardware profile JSON the planner can load.")
    add_kernels_arguments(kernels)
    return p


def add_steps_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sparselift calibrate steps``."""
    p.add_argument("--quick", action="store_true", help="two probe models, fewer steps (smoke test)")
    p.add_argument("--steps", type=int, help="timed steps per probe plan (default: the harness's, "
                   "measure.probe.DEFAULT_TIMING; quick 5)")
    p.add_argument("--warmup", type=int, help="untimed steps per probe plan (default: the harness's, "
                   "measure.probe.DEFAULT_TIMING)")
    add_store_argument(p)
    p.add_argument("--out", help="also write the profile JSON here")
    p.add_argument("--base", help="profile to start from (default: the shipped CPU profile)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--save-measurements", metavar="PATH", help="also save the probe plans and their measured "
                   "times here (refit later with --from-measurements)")
    p.add_argument("--from-measurements", metavar="PATH", help="refit from saved measurements (one process, "
                   "no torchrun, no measuring) and store the profile")
    p.add_argument("--png", metavar="FILE", help="also draw the fit: predicted against measured step per probe "
                   "plan, with the base profile's predictions and the MAPE (needs matplotlib)")


def add_store_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", help="profile store directory (default: $TORCHREC_SPARSELIFT_PROFILE_DIR or "
                   "~/.cache/torchrec_sparselift/profiles)")


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``sparselift calibrate check``."""
    add_store_argument(p)
    p.add_argument("--link", action="store_true", help="also measure the link this job sees (run under torchrun, "
                   "every rank, a few seconds) and fail when it differs from the stored profile's beyond the "
                   "measured spread")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``calibrate``'s arguments and run the subcommand; its exit code."""
    parser = build_calibrate_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.what == "steps":
        from torchrec_sparselift.measure.steps import run_steps  # trains TorchRec models

        return run_steps(args)
    if args.what == "check":
        from torchrec_sparselift.measure.steps import run_check  # reads the planner's fingerprint (torchrec)

        return run_check(args)
    if args.what == "kernels":
        return run_kernels(args)
    parser.print_help()
    return 2
