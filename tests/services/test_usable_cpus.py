"""`toolbus up`'s default and largest `--workers` follow the cores a container may use,
not the host's (`os.cpu_count()` is the host's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.config import default_workers, max_workers, usable_cpus


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "150000 100000\n"}, 2),  # v2, 1.5 CPUs: rounded up
    ({"cpu.max": "50000 100000\n"}, 1),  # v2, half a CPU: still one worker
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
    ({"cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
      "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 3),  # v1, the combined controller
])
def test_a_cgroup_cpu_quota_narrows_the_cores(tmp_path: Path, files: dict[str, str],
                                              quota: int) -> None:
    assert usable_cpus(_tree(tmp_path, files)) == min(_affinity(), quota)


@pytest.mark.parametrize("files", [
    {},  # no cgroup filesystem at all
    {"cpu.max": "max 100000\n"},  # v2 without a limit
    {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},  # v1 without
    {"cpu.max": "garbage\n"},  # unreadable: the affinity alone
    {"cpu/cpu.cfs_quota_us": "x\n", "cpu/cpu.cfs_period_us": "0\n"},
])
def test_without_a_quota_the_affinity_counts(tmp_path: Path, files: dict[str, str]) -> None:
    assert usable_cpus(_tree(tmp_path, files)) == _affinity()


def test_the_workers_follow_the_usable_cores() -> None:
    assert default_workers() == usable_cpus()
    assert max_workers() == max(8, 4 * usable_cpus())
