"""Run a sweep's runs as Ray tasks: one ``kveval run`` process per run, in its own resumable run folder.

    with ray_session(address=None, num_cpus=2):         # a local Ray in this process (or join a cluster)
        outcomes = run_tasks(tasks, resources, progress=SweepProgress(console, quiet))

Each task (:func:`execute_run`, on whichever node Ray picks) starts ``python -m kveval run CONFIG --quiet`` as a
child process, its output in the run's log file: a crash, an out-of-memory kill or a ``kill -9`` of one run ends
that process only, never the driver or the other runs, and the run folder's lock (``.kveval.lock``, an
``fcntl.flock``) keeps two processes out of one folder across processes and hosts of a shared file system. A run
that failed or was killed has kept every record it appended; the next sweep resumes it. What a task reports back
is a small dict (:class:`RunOutcome`): exit status, the one-line error, wall time, host.

On a cluster (``--address``), every node needs kveval installed and the sweep's folder (configs, run folders,
logs) on a shared file system at the same path as the driver's working directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kveval.errors import KvevalError

#: A run's states in sweep.json: ``finished`` (ran now), ``skipped`` (finished before, config unchanged),
#: ``failed`` (its one-line error beside it), ``interrupted`` (the sweep was stopped while it ran or waited).
FINISHED, SKIPPED, FAILED, INTERRUPTED = "finished", "skipped", "failed", "interrupted"
#: How much of a run's log is read for its error line.
LOG_TAIL_BYTES = 64 * 1024
#: Seconds a cancelled run gets to stop after SIGINT before it is killed.
STOP_GRACE_S = 5.0
#: How often a task looks up from waiting for its run's process (to notice a cancel or its time limit).
WAIT_SLICE_S = 0.5


@dataclass
class RunTask:
    """What a task needs: the run's ``name``, its config file (written by the sweep), its folder and log file,
    ``args`` added to ``kveval run`` (``--overwrite``, ``--allow-code``), the working directory and the time limit."""

    name: str
    config_file: str
    folder: str
    log_file: str
    cwd: str
    args: list[str] = field(default_factory=list)
    timeout_s: float | None = None


@dataclass
class RunOutcome:
    """One run's entry in sweep.json: ``status`` (FINISHED, SKIPPED, FAILED, INTERRUPTED), ``error`` (one line,
    None unless failed), the child's ``returncode``, ``wall_s`` (this sweep's time on it; None when skipped),
    ``host``, ``started``/``finished`` (ISO 8601, UTC), ``node`` (the Ray node that ran it: two nodes of one host
    tell apart by it)."""

    name: str
    status: str
    error: str | None = None
    returncode: int | None = None
    wall_s: float | None = None
    host: str | None = None
    started: str | None = None
    finished: str | None = None
    node: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def error_line(log_text: str, returncode: int, timed_out: bool = False, timeout_s: float | None = None) -> str:
    """The one line that says why a ``kveval run`` process failed, from the tail of its output: kveval's own
    ``error: ...`` line (bad input, exit 2), else the last line of a traceback, else how it ended (a signal)."""
    if timed_out:
        return f"timed out after {timeout_s:g} s and was killed; rerun the sweep to resume it"
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1].removeprefix("error:").strip()
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}; rerun the sweep to resume it"
        return f"killed by signal {-returncode}; rerun the sweep to resume it"
    if returncode == 130:
        return "interrupted; rerun the sweep to resume it"
    if any(line.startswith("Traceback") for line in lines):
        return lines[-1]
    return lines[-1] if lines else f"exit status {returncode}"


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(fh.tell() - LOG_TAIL_BYTES, 0))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _stop(proc: subprocess.Popen) -> None:
    """Stop a run's process group: SIGINT (kveval's clean interrupt), then SIGKILL after STOP_GRACE_S."""
    for sig, wait in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def _sigint_unblocked() -> Iterator[None]:
    """SIGINT unblocked in this thread for the block: a child started inside inherits the signal mask, and Ray's
    workers block SIGINT, which would leave ``kveval run`` deaf to the clean interrupt that stops it (:func:`_stop`)."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def execute_run(task: RunTask, on_start: Callable[[], None] | None = None) -> dict:
    """Run ``kveval run CONFIG --quiet`` for one run in a child process (its own process group, output to the
    run's log file) and return its :class:`RunOutcome` as a dict. A cancelled task (KeyboardInterrupt, which
    ``ray.cancel`` raises in it) stops the child first. This is the body of every Ray task; it needs no Ray."""
    Path(task.log_file).parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kveval", "run", task.config_file, "--quiet", *task.args]
    started, t0 = now(), time.perf_counter()
    timed_out = False
    with open(task.log_file, "ab") as log:
        log.write(f"\n# {started} on {socket.gethostname()}: {' '.join(command[1:])}\n".encode())
        log.flush()
        with _sigint_unblocked():
            proc = subprocess.Popen(command, cwd=task.cwd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        if on_start is not None:
            on_start()
        deadline = None if task.timeout_s is None else time.monotonic() + task.timeout_s
        try:
            while True:  # short waits: Ray's cancel raises KeyboardInterrupt only between Python bytecodes
                try:
                    returncode = proc.wait(timeout=WAIT_SLICE_S)
                    break
                except subprocess.TimeoutExpired:
                    if deadline is not None and time.monotonic() > deadline:
                        timed_out = True
                        _stop(proc)
                        returncode = proc.returncode
                        break
        except BaseException:  # the task was cancelled (KeyboardInterrupt) or its worker is going down
            _stop(proc)
            raise
    ok = returncode == 0 and not timed_out
    return RunOutcome(
        name=task.name, status=FINISHED if ok else FAILED, returncode=returncode,
        error=None if ok else error_line(_tail(task.log_file), returncode, timed_out, task.timeout_s),
        wall_s=round(time.perf_counter() - t0, 3), host=socket.gethostname(), started=started, finished=now(),
    ).to_dict()


# --------------------------------------------------------------------------------------------- Ray


def import_ray():
    """The ``ray`` module, or a one-line KvevalError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise KvevalError("kveval sweep runs on Ray, which is not installed: pip install 'kveval[sweep]' (the "
                          "README set-up, scripts/setup.sh, installs it)") from None
    return ray


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> Iterator:
    """Ray for the sweep's tasks: the session already started in this process if there is one (left running),
    else the cluster at ``address``, else a local Ray started in this process (``num_cpus`` / ``num_gpus``:
    what it offers, default the machine's; no dashboard, no usage statistics, bound to this host). A session
    this call started is shut down on exit. Yields the ``ray`` module."""
    ray = import_ray()
    if address:
        check_reachable(address)
    if ray.is_initialized():
        yield ray
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report to the network
    try:
        if address:
            with _native_stderr_held():  # Ray's C++ client warns once a second while it retries (20 s)
                ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        else:
            # address "local": a new Ray of this process, never the cluster a stale /tmp/ray/ray_current_cluster
            # (left by a Ray that was killed) or RAY_ADDRESS points to ("When connecting to an existing cluster,
            # num_cpus and num_gpus must not be provided")
            _local_token_in_environment()
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR", _node_ip_address="127.0.0.1")
    except (ConnectionError, ValueError, RuntimeError, ray.exceptions.RayError) as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise KvevalError(f"cannot start {where}: {_why_ray_failed(exc)}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _local_token_in_environment() -> None:
    """A local Ray (Ray 2.60, where token authentication is the default) turns token authentication on and, where
    the user has no token, writes one to ~/.ray/auth_token; from then on every ``ray start --head`` on the machine asks for it, and a ``kveval sweep
    --address`` to such a cluster is refused until RAY_AUTH_MODE=token is set. The local session gets a fresh token
    in this process's environment instead (inherited by its raylet and workers), so nothing is written to the
    user's home. A token or mode the user set is left as it is."""
    if any(name in os.environ for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return
    if (Path.home() / ".ray" / "auth_token").exists():
        return
    import secrets

    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[None]:
    """Hold what native code writes to file descriptor 2 in the block: written out after it if it succeeds, dropped
    if it raises (the raised error is then the one line the user sees)."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to hold
        yield
        return
    import tempfile

    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        text = held.read()
        if text:
            os.write(2, text)


def _why_ray_failed(exc: BaseException) -> str:
    """The first line of Ray's error; where Ray's own cause is a refused authentication token (a cluster started
    with token authentication, ``ray start`` turns it on when ``~/.ray/auth_token`` exists), what to set."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    cause: BaseException | None = exc
    while cause is not None and not (type(cause).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(cause)):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        first += ("; the cluster asks for Ray's authentication token: set RAY_AUTH_MODE=token and the cluster's "
                  "token in RAY_AUTH_TOKEN or ~/.ray/auth_token (or start the cluster with RAY_AUTH_MODE=disabled)")
    return first


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """KvevalError (one line) unless a TCP connection to the cluster's ``host:port`` (``ray://host:port`` too)
    opens within ``timeout_s``: Ray itself retries an unreachable address for minutes. ``auto`` (the cluster this
    machine belongs to) is left to Ray."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise KvevalError(f"--address {address!r}: give HOST:PORT of the Ray head (ray://HOST:10001 for Ray "
                          "Client, HOST:6379 for the GCS), or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise KvevalError(f"cannot reach the Ray cluster at {address} ({exc.strerror or type(exc).__name__}); is "
                          "its head running (ray start --head)?") from None


class _Board:
    """A Ray actor that the tasks tell when their run starts, so that the driver can show what is running (Ray
    itself says only what has finished)."""

    def __init__(self):
        self.started: set[str] = set()

    def start(self, name: str) -> None:
        self.started.add(name)

    def running(self) -> list[str]:
        return sorted(self.started)


def _ray_task(task: RunTask, board) -> dict:
    """The Ray task: :func:`execute_run`, telling ``board`` when the run's process has started; the outcome names
    the Ray node it ran on."""
    import ray

    out = execute_run(task, on_start=lambda: board.start.remote(task.name))
    out["node"] = ray.get_runtime_context().get_node_id()
    return out


def ray_options(num_cpus: float, num_gpus: float, memory: str | None) -> dict:
    """Ray's options for one run's task from the sweep's ``resources`` (no retries: a failed run is reported,
    and the next sweep resumes it)."""
    opts: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_retries": 0}
    if memory is not None:
        from kveval.units import parse_size

        opts["memory"] = parse_size(memory)
    return opts


class SweepProgress:
    """The sweep's progress: a bar of runs done with counts (done / running / failed / queued) on a terminal,
    one line per run that ends otherwise (``quiet`` or output not a terminal)."""

    def __init__(self, console: Console, quiet: bool = False):
        self.console = console
        self.quiet = quiet or not console.is_terminal
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    @contextlib.contextmanager
    def show(self, total: int) -> Iterator[SweepProgress]:
        if self.quiet:
            yield self
            return
        columns = [TextColumn("[bold]runs"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[counts]}"),
                   TimeElapsedColumn()]
        with Progress(*columns, console=self.console, transient=False) as bar:
            self._bar, self._task = bar, bar.add_task("runs", total=total, counts="")
            try:
                yield self
            finally:
                self._bar = None

    def update(self, done: int, running: int, failed: int, queued: int) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done + failed,
                             counts=f"{done} done, {running} running, {failed} failed, {queued} queued")

    def ended(self, outcome: RunOutcome, position: int, total: int) -> None:
        if outcome.status == FAILED:
            line = f"[{position}/{total}] {outcome.name}: failed: {outcome.error}"
        else:
            line = f"[{position}/{total}] {outcome.name}: {outcome.status} in {outcome.wall_s:.1f} s"
        self.console.print(line, highlight=False, markup=False)


def run_tasks(tasks: list[RunTask], options: dict, progress: SweepProgress,
              on_outcome: Callable[[RunOutcome], None] | None = None, poll_s: float = 0.5) -> list[RunOutcome]:
    """Submit every task to the Ray session of this process (:func:`ray_session`) with ``options``
    (:func:`ray_options`) and collect their outcomes as they end, in task order; ``on_outcome`` is called for
    each (sweep.json is rewritten there). A task whose worker died (a crash of Ray itself) is a failed run with
    Ray's one-line reason. Ctrl-C cancels the runs (each stops its child: SIGINT, then SIGKILL), marks them
    interrupted and re-raises."""
    import ray

    # the board lives on the driver's node: a node lost mid-sweep fails its own runs, never the sweep's bookkeeping
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    board = ray.remote(num_cpus=0, scheduling_strategy=here)(_Board).remote()
    remote = ray.remote(_ray_task).options(**options)
    pending = {remote.remote(task, board): task for task in tasks}
    outcomes: dict[str, RunOutcome] = {}
    failed = done = 0
    with progress.show(len(tasks)):
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=poll_s)
                for ref in ready:
                    task = pending.pop(ref)
                    try:
                        outcome = RunOutcome(**ray.get(ref))
                    except ray.exceptions.RayError as exc:
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                        outcome = RunOutcome(task.name, FAILED, error=f"Ray: {type(exc).__name__}: {first}",
                                             finished=now())
                    outcomes[task.name] = outcome
                    failed += outcome.status == FAILED
                    done += outcome.status != FAILED
                    progress.ended(outcome, done + failed, len(tasks))
                    if on_outcome is not None:
                        on_outcome(outcome)
                try:
                    started = set(ray.get(board.running.remote(), timeout=poll_s * 10))  # type: ignore[attr-defined]
                except ray.exceptions.RayError:  # the board is not answering: counts as queued until it does
                    started = set()
                running = sum(1 for t in pending.values() if t.name in started)
                progress.update(done, running, failed, len(pending) - running)
        except KeyboardInterrupt:
            for ref in pending:
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
            with contextlib.suppress(ray.exceptions.RayError):  # let each task stop its child (SIGINT, SIGKILL)
                ray.wait(list(pending), num_returns=len(pending), timeout=STOP_GRACE_S + 5)
            for ref, task in pending.items():
                try:  # a run that ended on its own before the cancel reached it keeps its outcome
                    outcome = RunOutcome(**ray.get(ref, timeout=0.1))
                except ray.exceptions.RayError:  # cancelled, or still stopping (GetTimeoutError is one too)
                    outcome = RunOutcome(task.name, INTERRUPTED, error="the sweep was interrupted; rerun it to "
                                         "resume this run", finished=now())
                outcomes[task.name] = outcome
                if on_outcome is not None:
                    on_outcome(outcome)
            raise
    return [outcomes[t.name] for t in tasks]
