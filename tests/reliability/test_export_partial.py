"""Writes cut short: an export killed part-way (SIGKILL: no `finally` runs) leaves a hidden partial folder that the
next export of the same target removes, a live writer's folder stays; a target the kernel will not write (even for
root, where os.access says yes) is refused before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kveval.errors import KvevalError
from kveval.fileio import remove_stale_folders


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_writers_partial_folder_goes_and_a_live_writers_stays(tmp_path):
    target = tmp_path / "ckpt"
    dead = tmp_path / f".ckpt.0123abcd.pid{_dead_pid()}"
    live = tmp_path / f".ckpt.89abcdef.pid{os.getppid()}"
    other = tmp_path / f".other.0123abcd.pid{_dead_pid()}"  # another target's
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 1024)
    assert remove_stale_folders(target) == [dead]
    assert not dead.exists() and live.is_dir() and other.is_dir()


def test_an_export_killed_part_way_leaves_nothing_after_the_next_export(tmp_path):
    """The export writes into `.<target>.<random>.pid<N>`; a process killed with SIGKILL while writing leaves it;
    the next export (here: the same atomic write path the export takes) removes it and completes."""
    from kveval.fileio import atomic_path

    target = tmp_path / "ckpt"
    code = (f"import os, time\nfrom kveval.fileio import atomic_path\n"
            f"with atomic_path({str(target)!r}, folder=True, suffix=f'.pid{{os.getpid()}}') as tmp:\n"
            f"    (tmp / 'part').write_bytes(b'x' * 4096)\n    print('writing', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]
    assert len(left) == 1 and not target.exists()
    remove_stale_folders(target)
    with atomic_path(target, folder=True, suffix=f".pid{os.getpid()}") as tmp:
        (tmp / "model.safetensors").write_bytes(b"done")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_target_the_kernel_will_not_write_is_refused_even_for_root():
    from kveval.config.checks import check_writable_path

    with pytest.raises(KvevalError, match="not writable"):
        check_writable_path(Path("/proc/kveval-export-target"), "--export", folder=True)
