"""``kveval sweep --address`` on a real two-node Ray cluster on this machine, started the way users start one: ``ray
start --head`` on 127.0.0.1 and a second ``ray start --address`` joining it, each node with one CPU of its own. The
sweep's runs are placed on both nodes; the second node then goes down mid-sweep (its raylet and every process under
it, the ``kveval run`` included, killed as a machine going down takes them); the sweep reports that run failed and
finishes the other; the same command, on the one node left, resumes the lost run from its records and completes it
with the numbers of an uninterrupted run. Then the cluster is stopped (only its own processes: other tests' Ray
sessions on this machine are left alone).

Skipped, with the reason, where ray is not installed or its cluster cannot start here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from sweep_reference import uninterrupted_metrics

ray = pytest.importorskip("ray", reason="kveval sweep needs ray: pip install 'kveval[sweep]'")

SHORT = {"perplexity": {"seq_len": 32, "max_tokens": 96, "bootstrap": 20, "noise_windows": 0}}
LONG = {"perplexity": {"seq_len": 64, "max_tokens": 16384, "bootstrap": 20, "noise_windows": 0}}
#: Records a long run has written before its node is lost (of 256).
RECORDS_BEFORE_LOSS = 8


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _children() -> dict[int, list[int]]:
    """pid -> its child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_trees(roots: list[int]) -> list[int]:
    """SIGKILL every process in the trees under ``roots`` (roots included); returns the pids."""
    tree, todo, pids = _children(), list(roots), []
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(tree.get(pid, []))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)


def _processes_with(text: str) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and text in _cmdline(int(p.name))]


class RayCluster:
    """A head and ``nodes - 1`` more nodes started with the ``ray`` command line, on 127.0.0.1, one CPU each, every
    port chosen free (other tests' Ray sessions run on this machine too). ``address`` is the head's GCS; ``env``
    what the nodes are started with; ``lose(i)`` kills node ``i``'s raylet and everything under it."""

    def __init__(self, nodes: int = 2, env: dict[str, str] | None = None):
        ray_cli = str(Path(sys.executable).with_name("ray"))
        if not Path(ray_cli).is_file():
            pytest.skip(f"the ray command line is not beside this Python ({ray_cli}); pip install 'kveval[sweep]'")
        self.temp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")  # short: Ray's unix sockets live under it
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        gcs, *ports = _free_ports(1 + 6 * nodes)
        self.address = f"127.0.0.1:{gcs}"
        self.node_ports = ports[::6]  # each node's node manager port names its raylet
        for i in range(nodes):
            manager, objects, listen, grpc, metrics, runtime_env = ports[6 * i:6 * i + 6]
            where = (["--head", "--port", str(gcs), "--temp-dir", self.temp, "--include-dashboard", "false"] if i == 0
                     else ["--address", self.address])
            cmd = [ray_cli, "start", *where, "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                   "--node-manager-port", str(manager), "--object-manager-port", str(objects),
                   "--dashboard-agent-listen-port", str(listen), "--dashboard-agent-grpc-port", str(grpc),
                   "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(runtime_env),
                   "--disable-usage-stats", "--include-log-monitor", "false"]
            done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
            if done.returncode != 0:
                self.stop()
                pytest.skip(f"a Ray cluster cannot start here: ray start {where[0]} exited {done.returncode}: "
                            f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        self.raylets = [self._raylet_of(port) for port in self.node_ports]

    def node_ids(self) -> set[str]:
        """The live nodes' ids, asked of the cluster by a driver of its own."""
        ask = ("import json, sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR'); "
               "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))")
        done = subprocess.run([sys.executable, "-c", ask, self.address], env=self.env, capture_output=True,
                              text=True, timeout=120, check=True)
        return set(json.loads(done.stdout.strip().splitlines()[-1]))

    def _raylet_of(self, port: int) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = [p for p in _processes_with(f"--node_manager_port={port}") if "raylet" in _cmdline(p).split()[0]]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no raylet with node manager port {port}")

    def lose(self, node: int) -> list[int]:
        """Kill node ``node`` (its raylet and every process under it); returns once they are gone."""
        pids = _kill_trees([self.raylets[node]])
        _wait_gone(pids)
        return pids

    def stop(self) -> None:
        """Kill this cluster's processes (those naming its temp folder or one of its node manager ports, and
        everything under them), never another Ray on this machine."""
        roots = set(_processes_with(self.temp))
        for port in getattr(self, "node_ports", []):
            roots |= set(_processes_with(f"--node_manager_port={port}"))
        _wait_gone(_kill_trees(sorted(roots)))
        shutil.rmtree(self.temp, ignore_errors=True)


@contextlib.contextmanager
def ray_cluster(nodes: int = 2, env: dict[str, str] | None = None):
    c = RayCluster(nodes, env)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the sweeps' drivers as the cluster: no token
    with ray_cluster(2) as c:
        yield c


def _kveval_sweep(path: Path, address: str | None, env: dict[str, str] | None = None,
                  args: list[str] | None = None) -> subprocess.CompletedProcess:
    """``kveval sweep PATH --address ADDRESS ARGS`` as users run it: its own process (Ray keeps per-process state,
    its authentication settings among them, that an earlier session of a test process would leak into the next)."""
    cmd = ["kveval", "sweep", str(path), *(["--address", address] if address else []), *(args or [])]
    return _kveval(cmd, env)


def _kveval(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A ``kveval ...`` command line, run with this Python."""
    assert cmd[0] == "kveval", cmd
    return subprocess.run([sys.executable, "-m", "kveval", *cmd[1:]], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=900)


def _sweep_file(path: Path, out: Path | None, runs: list[dict]) -> Path:
    data = {"name": "c", **({"output": str(out)} if out else {}), "base": {"data": "builtin", "tasks": [SHORT]},
            "resources": {"num_cpus": 1}, "runs": runs}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _lines(path: Path) -> list[str]:
    """The whole lines of ``path`` (a last line without its newline, being written or torn, left out)."""
    try:
        return path.read_text().split("\n")[:-1]
    except OSError:
        return []


def _lose_second_node_once_both_run(out: Path, names: list[str], cluster: RayCluster, lost: dict) -> None:
    """When every run of ``names`` has RECORDS_BEFORE_LOSS records: the second node (not the head, where the
    driver is) goes down; ``lost`` gets which run was on it and its records at that moment."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        records = {n: _lines(out / "runs" / n / "records.jsonl") for n in names}
        if all(len(r) >= RECORDS_BEFORE_LOSS for r in records.values()):
            pids = {n: json.loads((out / "runs" / n / ".kveval.lock").read_text())["pid"] for n in names}
            killed = cluster.lose(1)
            lost["runs"] = [n for n, pid in pids.items() if pid in killed]
            lost["records"] = {n: _lines(out / "runs" / n / "records.jsonl") for n in lost["runs"]}
            return
        time.sleep(0.05)


def test_a_sweep_on_two_nodes_survives_losing_one(tmp_path, cluster):
    out = tmp_path / "sweep"
    # two short runs at once, one CPU each, on two one-CPU nodes: one on each node
    first = _sweep_file(tmp_path / "a.yaml", out, [
        {"name": "a", "config": {"model": "builtin:tiny-llama", "kv": ["int8"]}},
        {"name": "b", "config": {"model": "builtin:tiny-llama", "kv": ["int4_g32"]}}])
    result = _kveval_sweep(first, cluster.address)
    assert result.returncode == 0, result.stdout + result.stderr
    nodes = {r["name"]: r["node"] for r in json.loads((out / "sweep.json").read_text())["runs"]}
    ids = cluster.node_ids()
    assert set(nodes.values()) == ids and len(ids) == 2, (nodes, ids)

    # a long run on each node; the second node goes down while both are recording
    names = ["long_a", "long_b"]
    runs = [{"name": n, "config": {"model": "builtin:tiny-llama", "kv": [kv], "tasks": [LONG]}}
            for n, kv in zip(names, ("int8", "int4_g32"))]
    path = _sweep_file(tmp_path / "b.yaml", None, runs)  # its folder given on the command line
    lost: dict = {}
    watcher = threading.Thread(target=_lose_second_node_once_both_run, args=(out, names, cluster, lost),
                               daemon=True)
    watcher.start()
    broken = _kveval_sweep(path, cluster.address, args=["-o", str(out)])
    watcher.join(timeout=5)
    assert lost.get("runs") and len(lost["runs"]) == 1, (lost, broken.stdout)
    (gone,) = lost["runs"]
    (kept,) = set(names) - {gone}
    assert broken.returncode == 1, broken.stdout + broken.stderr
    status = {r["name"]: r["status"] for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert status == {gone: "failed", kept: "finished"}, (status, broken.stdout)

    # the same command (as sweep.json records it, pasted back) on the one node left: the finished run skipped, the
    # lost one resumed and completed (also when it was lost after its metrics, drawing its report: a loaded machine
    # can start one node's run late enough for the other to have recorded everything; CI saw it)
    command = json.loads((out / "sweep.json").read_text())["command"]
    assert shlex.split(command) == ["kveval", "sweep", str(path), "-o", str(out), "--address", cluster.address]
    again = _kveval(shlex.split(command))
    assert again.returncode == 0, again.stdout + again.stderr
    status = {r["name"]: r["status"] for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert status == {kept: "skipped", gone: "finished"}, status
    final = _lines(out / "runs" / gone / "records.jsonl")
    before = lost["records"][gone]
    assert len(before) >= RECORDS_BEFORE_LOSS
    assert final[:len(before)] == before  # resumed: what was recorded before the loss is kept
    keys = [json.loads(line)["key"] for line in final]
    assert len(keys) == len(set(keys))  # each unit once

    # the numbers of an uninterrupted run of the same config (one thread, as the runs had one CPU each)
    expected = uninterrupted_metrics(out / "configs" / f"{gone}.yaml", tmp_path / "reference")
    policy = runs[names.index(gone)]["config"]["kv"][0]
    resumed = json.loads((out / "runs" / gone / "metrics.json").read_text())["policies"][policy]
    for key in ("ppl", "kld_mean", "delta_ppl_pct"):
        assert resumed[key] == pytest.approx(expected["policies"][policy][key], rel=1e-9), key


def test_a_cluster_asking_for_a_token_is_one_line_saying_what_to_set(tmp_path):
    """A cluster started with token authentication (``ray start`` turns it on by itself where ~/.ray/auth_token
    exists) refuses a driver without the token, and Ray's own error says only "Failed to connect" (after 20 s of
    C++ warnings). kveval's line names the setting, nothing else reaches stderr, the last sweep.json is left as it
    was, and doing what the line says connects."""
    token = "0123456789abcdef0123456789abcdef"
    home = {"HOME": str(tmp_path)}  # no ~/.ray/auth_token of this machine's user
    out = tmp_path / "sweep"
    path = _sweep_file(tmp_path / "s.yaml", out, [{"name": "a", "config": {"model": "builtin:tiny-llama",
                                                                           "kv": ["int8"]}}])
    with ray_cluster(1, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}) as c, \
            _without("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        refused = _kveval_sweep(path, c.address, home)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        (line,) = refused.stderr.splitlines()
        assert line.startswith(f"error: cannot start the Ray cluster at {c.address}: ")
        assert "set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN" in line
        assert not (out / "sweep.json").exists()

        done = _kveval_sweep(path, c.address, {**home, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
        assert done.returncode == 0, done.stdout + done.stderr
        assert [r["status"] for r in json.loads((out / "sweep.json").read_text())["runs"]] == ["finished"]


def test_a_local_sweep_writes_no_token_to_the_users_home(tmp_path):
    """Ray's local ``ray.init()`` writes ~/.ray/auth_token where there is none, after which every ``ray start
    --head`` on the machine asks for that token (and ``kveval sweep --address`` is refused, above). A local sweep
    leaves the home as it was."""
    out = tmp_path / "sweep"
    path = _sweep_file(tmp_path / "s.yaml", out, [{"name": "a", "config": {"model": "builtin:tiny-llama",
                                                                           "kv": ["int8"]}}])
    with _without("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        done = _kveval_sweep(path, None, {"HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "home" / ".ray").exists()


@contextlib.contextmanager
def _without(*names: str):
    """This process's environment (which the kveval processes start from) without ``names`` for the block."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
