"""The one launcher for multi-process tests: it starts ranks in either of two ways.

- :func:`run_ranks` runs a Python function on ``world_size`` fresh processes, joined in a gloo
  process group on a free port (or in none, ``backend=None``), and returns each rank's return
  value in rank order. A rank that raises fails the call with that rank's traceback. The ranks
  fork from one forkserver per test run that imported torch and TorchRec once (:data:`PRELOAD`),
  each with the caller's environment: a call costs ~0.1 s instead of ~2 s of imports per rank.
- :func:`start_script` / :func:`run_script` run a script as ``world_size`` rank processes with
  torchrun's environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...), or under
  torchrun itself (``torchrun=True``), and return every rank's exit code and output.

A failed rank of :func:`run_ranks` raises :class:`LaunchError` naming the rank and what it said (a
Python error, a signal); a script's ranks report their exit codes and output for the test to check
(:meth:`ScriptResult.tail` for the assertion message). Both raise :class:`LaunchTimeout` past their
timeout, which only guards against hangs. A rank that aborts in native code (SIGABRT, no Python
error) raises :class:`NativeAbort`; ``run_ranks(..., retry_native_abort=True)`` runs once more
then. A rank leaves with ``os._exit`` once its outcome is written, so the interpreter's
finalization cannot race gloo's worker threads (that race aborted ranks with "terminate called
without an active exception" after their work was done). A rank that raises, or any other exit,
fails at once.

Import it from a test module (pytest puts ``tests/`` on the path)::

    from launcher import run_ranks
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import attrs

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "NativeAbort",
    "ScriptRanks",
    "ScriptResult",
    "free_port",
    "run_ranks",
    "run_script",
    "start_script",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_POLL_S = 0.05
_TAIL = 3000


class LaunchError(RuntimeError):
    """A rank raised, was killed by a signal, or exited with an error."""


class LaunchTimeout(LaunchError):
    """The ranks did not finish within the launch's timeout (they were killed)."""


class NativeAbort(LaunchError):
    """A rank was killed by SIGABRT without a Python error (native code aborted)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: int) -> dict:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))  # fmt: skip


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


# -- a Python function on N ranks ------------------------------------------------------------


#: what the forkserver (run_ranks' default start) imports once, so that a rank forks with them
#: imported instead of importing them again (~2 s a rank on this machine); never the package
#: itself, so every rank runs the package as it is on disk
PRELOAD = ("torch", "torch.distributed", "torchrec")


def _set_environ(env: Mapping[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


class _Environ:
    """The caller's environment, set in the rank process as it is unpickled: before ``fn`` (and
    the test module it imports) is, as a spawned rank would have it from the start. A forkserver's
    ranks otherwise inherit the environment the forkserver started with."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)

    def __reduce__(self):
        return (_set_environ, (self.env,))


def _rank_main(environ: None, rank: int, fn: Callable[..., Any], world_size: int, port: int,
               backend: Optional[str], out_dir: str, args: tuple) -> None:
    """Child process: set the rank's environment, join the group, run ``fn``, write its outcome
    (``environ``: the caller's environment, already set by unpickling, see :class:`_Environ`)."""
    os.environ.update(_rank_env(rank, world_size, port))
    failed = True
    try:
        if backend is None:
            outcome = ("ok", fn(rank, world_size, *args))
        else:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            dist.init_process_group(backend, rank=rank, world_size=world_size)
            try:
                outcome = ("ok", fn(rank, world_size, *args))
            finally:
                dist.destroy_process_group()
        payload = pickle.dumps(outcome)
        failed = False
    except BaseException:  # noqa: BLE001 - the parent raises it with this traceback
        payload = pickle.dumps(("error", traceback.format_exc()))
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)
    # Leave without finalizing the interpreter: a gloo worker thread may still be dropping the
    # tensors of the last collective, and taking the GIL for that during finalization aborts the
    # process (std::terminate from ProcessGroupGloo::runLoop, seen in core dumps) after the rank's
    # work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def _read_outcome(out_dir: str, rank: int) -> Optional[Tuple[str, Any]]:
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, backend: Optional[str],
              start_method: str) -> List[Any]:
    import multiprocessing

    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (once)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="launcher_") as out_dir:
        procs = [ctx.Process(target=_rank_main,
                             args=(_Environ(os.environ), r, fn, world_size, port, backend, out_dir, args),
                             name=f"rank{r}", daemon=False) for r in range(world_size)]  # fmt: skip
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                codes = [p.exitcode for p in procs]
                # a failed rank: the others would wait for it in a collective, so stop them now
                failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is not None or None not in codes or time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join()
        outcomes = [_read_outcome(out_dir, r) for r in range(world_size)]

    name = getattr(fn, "__qualname__", repr(fn))
    errors = [f"rank {r} raised:\n{o[1]}" for r, o in enumerate(outcomes) if o is not None and o[0] == "error"]
    if errors:
        raise LaunchError(f"{name} on {world_size} ranks:\n" + "\n".join(errors))
    if failed is not None:
        code = codes[failed]
        how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
        kind = NativeAbort if code == -signal.SIGABRT else LaunchError
        raise kind(f"rank {failed} of {world_size} {how} without a Python error (running {name})")
    if None not in codes:
        return [o[1] for o in outcomes]  # type: ignore[index]
    unfinished = [r for r, c in enumerate(codes) if c is None]
    raise LaunchTimeout(
        f"ranks {unfinished} of {world_size} did not finish {name} within "
        f"{timeout_s:g} s and were killed (a hang, or a machine too loaded: raise timeout_s)"
    )


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              backend: Optional[str] = "gloo", start_method: str = "forkserver",
              retry_native_abort: bool = False) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; their return values in
    rank order.

    Each rank gets torchrun's environment variables and, with ``backend`` (default gloo), the
    default process group, initialized before ``fn`` and destroyed after it; one torch thread per
    rank, and this process's environment as it is at the call. ``fn``, ``args`` and the results
    must pickle (define ``fn`` at module level) with ``start_method="forkserver"`` (default: the
    ranks fork from one server process of this test run that imported :data:`PRELOAD` and nothing
    else, then import ``fn``'s module) and ``"spawn"`` (a fresh interpreter: use it where a rank
    must not have torch imported before ``fn``); ``"fork"`` inherits the test process.

    Raises :class:`LaunchError` with the traceback of every rank that raised (the other ranks are
    stopped as soon as one fails), or naming the rank a signal killed; :class:`LaunchTimeout` when
    a rank runs longer than ``timeout_s``. ``retry_native_abort``: run once more when a rank was
    killed by SIGABRT without a Python error (TorchRec's native abort on CPU, see the module)."""
    if world_size < 1:
        raise ValueError(f"run_ranks needs world_size >= 1, got {world_size}")
    attempts = 2 if retry_native_abort else 1
    for attempt in range(attempts):
        try:
            return _run_once(fn, world_size, args, timeout_s, backend, start_method)
        except NativeAbort as e:
            if attempt == attempts - 1:
                raise
            print(f"[launcher] {e}; running again (TorchRec's native abort on CPU)", file=sys.stderr)
    raise AssertionError("unreachable")


# -- a script on N ranks ---------------------------------------------------------------------


@attrs.frozen
class ScriptResult:
    """Exit code, stdout and stderr of every rank process (of the torchrun process under torchrun)."""

    command: Tuple[str, ...]
    returncodes: Tuple[int, ...]
    stdouts: Tuple[str, ...]
    stderrs: Tuple[str, ...]

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.returncodes)

    @property
    def stdout(self) -> str:
        """Rank 0's stdout (the torchrun process's under torchrun)."""
        return self.stdouts[0]

    @property
    def stderr(self) -> str:
        """Every rank's stderr, rank order."""
        return "".join(self.stderrs)

    def tail(self, chars: int = _TAIL) -> str:
        """The end of every rank's stdout and stderr, for an assertion message."""
        parts = [f"$ {' '.join(self.command)}"]
        for r, (code, out, err) in enumerate(zip(self.returncodes, self.stdouts, self.stderrs)):
            parts.append(f"--- rank {r}: exit {code}\n{out[-chars:]}{err[-chars:]}")
        return "\n".join(parts)


class ScriptRanks:
    """Rank processes of a script, running; :meth:`wait` collects them (see :func:`start_script`)."""

    def __init__(self, command: Sequence[str], envs: Sequence[Mapping[str, str]], cwd: str,
                 timeout_s: float) -> None:
        self.command = tuple(command)
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._procs = [subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        cwd=cwd, env=dict(env)) for env in envs]  # fmt: skip

    def wait_rank(self, rank: int, timeout_s: float) -> Optional[int]:
        """Rank ``rank``'s exit code once it exits within ``timeout_s``, else None (it keeps running)."""
        try:
            return self._procs[rank].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill_rank(self, rank: int) -> None:
        """SIGKILL rank ``rank``'s process (a stopped one too)."""
        if self._procs[rank].poll() is None:
            self._procs[rank].kill()

    def wait(self) -> ScriptResult:
        """Wait for every rank; a rank still running at the start's ``timeout_s`` raises
        :class:`LaunchTimeout` (every rank killed, their output in the message)."""
        outs: List[Tuple[str, str]] = []
        timed_out = False
        try:
            for p in self._procs:
                try:
                    outs.append(p.communicate(timeout=max(self._deadline - time.monotonic(), 0.01)))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
        finally:
            for p in self._procs:
                if p.poll() is None:
                    p.kill()
            outs += [p.communicate() for p in self._procs[len(outs):]]
        result = ScriptResult(self.command, tuple(p.returncode for p in self._procs),
                              tuple(o for o, _ in outs), tuple(e for _, e in outs))  # fmt: skip
        if timed_out:
            raise LaunchTimeout(f"{len(self._procs)} rank process(es) did not finish within {self.timeout_s:g} s "
                                f"and were killed (a hang, or a machine too loaded: raise timeout_s)\n{result.tail()}")
        return result


def start_script(script: str, args: Sequence[str] = (), world_size: int = 2, *, torchrun: bool = False,
                 torchrun_args: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
                 cwd: str = ROOT, timeout_s: float = 180.0) -> ScriptRanks:
    """Start ``python script *args`` as ``world_size`` ranks and return at once.

    Without ``torchrun`` each rank is its own process with torchrun's environment variables on a
    free port (no launcher process: one torch import fewer per run). With ``torchrun=True`` one
    ``python -m torch.distributed.run --standalone --nproc_per_node world_size *torchrun_args``
    process starts the ranks (use it to test torchrun's own behaviour, e.g. restarts). ``env``
    replaces the environment (default: this process's, with ``OMP_NUM_THREADS=1`` and no
    inherited ``RANK``)."""
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.pop("RANK", None)
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(world_size), *torchrun_args, script, *args]  # fmt: skip
        return ScriptRanks(command, [base], cwd, timeout_s)
    port = free_port()
    envs = [{**base, **_rank_env(r, world_size, port)} for r in range(world_size)]
    return ScriptRanks([sys.executable, script, *args], envs, cwd, timeout_s)


def run_script(script: str, args: Sequence[str] = (), world_size: int = 2, **kwargs: Any) -> ScriptResult:
    """:func:`start_script`, then :meth:`ScriptRanks.wait`."""
    return start_script(script, args, world_size, **kwargs).wait()
