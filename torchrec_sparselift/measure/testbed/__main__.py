"""``python -m torchrec_sparselift.measure.testbed``: a torchrun job on emulated hosts (docs/testbed.md).

The command line of the testbed package; :func:`main` takes its arguments (tests call it directly)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from torchrec_sparselift.measure.testbed.bed import HostResult, emulated_hosts
from torchrec_sparselift.measure.testbed.layout import HostLayout, HostLayoutError, format_rate, parse_rate, parse_size
from torchrec_sparselift.measure.testbed.namespaces import (
    TestbedError,
    TestbedUnavailable,
    cleanup_stale,
    require_available,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_sparselift.measure.testbed",
        description=(
            "Run a torchrun job on emulated hosts: one network namespace per host, hosts joined "
            "by veth links shaped with tc tbf. Needs root. See docs/testbed.md."
        ),
        epilog="example: --hosts 2 --ranks-per-host 2 --rate 1gbit -- examples/train.py --steps 20",
    )
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts (network namespaces), default 2")
    p.add_argument("--ranks-per-host", type=int, default=1, help="torchrun ranks per host, default 1")
    p.add_argument("--rate", help="link rate per direction, e.g. 1gbit, 300mbit (default: unshaped)")
    p.add_argument("--shared", action="store_true", help="all traffic between hosts shares one link of --rate")
    p.add_argument("--burst", help="token bucket depth (default: four of the largest packets, 64kb between hosts, "
                   "256kb on a shaped loopback; docs/testbed.md)")
    p.add_argument("--packet", default="16kb", help="largest packet on the links between hosts (GSO size), "
                   "default 16kb")
    p.add_argument("--queue-latency-ms", type=float, default=50.0, help="tbf queue limit in ms, default 50")
    p.add_argument("--check", action="store_true", help="measure the link between host 0 and host 1 and print it")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the job is killed, default 3600")
    p.add_argument("--grace", type=float, default=30.0, help="seconds the other hosts get to finish once one host "
                   "failed, before they are killed; default 30")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port inside the namespaces")
    p.add_argument("--cleanup", action="store_true", help="only remove leftovers of dead runs, then exit")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS... run under torchrun on every host")
    return p


def _job_code(code: int) -> int:
    """A worker's exit code as a shell reports it: a signal N (torchrun's ``-N``) is 128 + N."""
    return 128 - code if code < 0 else code


def _report(results: Sequence[HostResult]) -> int:
    """Print how each host ended (its job's own exit code too) and return the job's exit code: 0
    when every host succeeded, else the failed worker's code of the host that failed first
    (torchrun itself exits 1 whatever it was), 1 when no worker reported one."""
    for r in results:
        state = "killed" if r.killed else f"exit {r.returncode}"
        if r.job_returncode is not None:
            state += f" (job exit {_job_code(r.job_returncode)})"
        print(f"testbed: host {r.host}: {state}", file=sys.stderr)
    bad = [r for r in results if not r.ok]
    if not bad:
        print("testbed: job exit 0", file=sys.stderr)
        return 0
    ended = sorted((r for r in bad if not r.killed), key=lambda r: (r.ended_s is None, r.ended_s or 0.0, r.host))
    first = ended[0] if ended else bad[0]
    if first.job_returncode is not None and first.job_returncode != 0:
        code = _job_code(first.job_returncode)
    else:
        code = first.returncode if first.returncode is not None and 0 < first.returncode < 128 else 1
    code = code if 0 < code < 256 else 1
    print(f"testbed: job exit {code} (host {first.host} failed first)", file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    script = list(args.script)
    if script[:1] == ["--"]:
        script = script[1:]
    try:
        if args.cleanup:
            require_available()
            removed = cleanup_stale()
            print(f"removed {len(removed)} leftover namespace(s)" + (f": {' '.join(removed)}" if removed else ""))
            return 0
        layout = HostLayout(
            hosts=args.hosts,
            ranks_per_host=args.ranks_per_host,
            rate_bps=None if args.rate is None else parse_rate(args.rate),
            shared=args.shared,
            packet_bytes=parse_size(args.packet),
            **({} if args.burst is None else dict(burst_bytes=parse_size(args.burst))),
            queue_latency_s=args.queue_latency_ms / 1e3,
        )
        if not script and not args.check:
            print("nothing to do: give --check and/or -- SCRIPT ARGS...", file=sys.stderr)
            return 2
        with emulated_hosts(layout) as bed:
            print(f"testbed: {layout.describe()}; master {bed.master_addr}:{args.master_port}", flush=True)
            if args.check:
                print(bed.measure_link(0), flush=True)
                if layout.hosts > 1:
                    print(bed.measure_link(1, 0), flush=True)
                    both = bed.measure_links([(0, 1), (1, 0)])
                    total = sum(m.bulk_bytes for m in both) * 8 / max(m.bulk_s for m in both)
                    print(f"both directions at once: {format_rate(total)} in total", flush=True)
                    for m in both:
                        print(f"  {m}", flush=True)
            if not script:
                return 0
            results = bed.torchrun(script, timeout_s=args.timeout, capture=False, master_port=args.master_port,
                                   grace_s=args.grace)
        return _report(results)
    except (HostLayoutError, TestbedUnavailable, TestbedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the emulated hosts were removed", file=sys.stderr)
        return 130
    except SystemExit as e:
        if isinstance(e.code, int) and e.code > 128:
            print(f"stopped by signal {e.code - 128}; the emulated hosts were removed", file=sys.stderr)
        raise


if __name__ == "__main__":
    sys.exit(main())
