"""``sparselift calibrate {steps,check,kernels}``: the one command for every calibration.

    torchrun --standalone --nproc_per_node 2 -m torchrec_sparselift calibrate steps [--quick]
    sparselift calibrate steps --from-measurements PATH      # refit a saved set, one process
    sparselift calibrate check                                # 0: this machine's profile is current
    sparselift calibrate kernels --out FILE [--quick]         # kernel microbenchmarks -> profile JSON

``steps`` and ``check``: :mod:`torchrec_sparselift.measure.steps`; ``kernels``:
:mod:`torchrec_sparselift.measure.kernels`.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from torchrec_sparselift.measure.kernels import add_kernels_arguments, run_kernels

__all__ = ["build_calibrate_parser", "main"]


def build_calibrate_parser() -> argparse.ArgumentParser:
    from torchrec_sparselift.measure.steps import add_check_arguments, add_steps_arguments  # torchrec

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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``calibrate``'s arguments and run the subcommand; its exit code."""
    parser = build_calibrate_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.what == "steps":
        from torchrec_sparselift.measure.steps import run_steps

        return run_steps(args)
    if args.what == "check":
        from torchrec_sparselift.measure.steps import run_check

        return run_check(args)
    if args.what == "kernels":
        return run_kernels(args)
    parser.print_help()
    return 2
