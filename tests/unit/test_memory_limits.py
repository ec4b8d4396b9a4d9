"""The CPU memory limit the preflight check compares with: host MemAvailable or a tighter cgroup (v1 and
v2, every level up to the root, inactive file pages counted as free), and the sum over ranks sharing it."""

from __future__ import annotations

from pathlib import Path

from accelerate_memsafe.memory.limits import cgroup_limits, cpu_memory_limit
from accelerate_memsafe.pipeline import MemoryEstimate, RankBudget, budget_problems

GIB = 2**30


def _v2(tmp_path: Path, *, pod_max: str, leaf_max: str = "max", current: int = 3 * GIB, inactive: int = GIB) -> Path:
    root = tmp_path / "cgroup"
    leaf = root / "kubepods" / "pod1"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "kubepods" / "memory.max").write_text(pod_max + "\n")
    (root / "kubepods" / "memory.current").write_text(f"{current}\n")
    (root / "kubepods" / "memory.stat").write_text(f"anon {current - inactive}\ninactive_file {inactive}\n")
    (leaf / "memory.max").write_text(leaf_max + "\n")
    (leaf / "memory.current").write_text(f"{current}\n")
    (leaf / "memory.stat").write_text(f"inactive_file {inactive}\n")
    proc = tmp_path / "cgroup_of_proc"
    proc.write_text("0::/kubepods/pod1\n")
    return proc


def test_a_parent_cgroup_v2_limit_binds_and_inactive_file_pages_count_as_free(tmp_path):
    proc = _v2(tmp_path, pod_max=str(8 * GIB))
    limits = cgroup_limits(proc, tmp_path / "cgroup")
    assert [(d.name, lim, used) for d, lim, used in limits] == [("kubepods", 8 * GIB, 2 * GIB)]
    limit = cpu_memory_limit(100 * GIB, proc_cgroup=proc, root=tmp_path / "cgroup", hostname="node7")
    assert limit.available == 6 * GIB
    assert limit.source.startswith("cgroup memory.max of ") and "kubepods (limit 8.00 GiB, 2.00 GiB in use)" in limit.source
    assert limit.key == f"node7:{tmp_path / 'cgroup' / 'kubepods'}"


def test_the_host_wins_when_it_has_less_free_than_the_cgroup(tmp_path):
    proc = _v2(tmp_path, pod_max=str(64 * GIB))
    limit = cpu_memory_limit(4 * GIB, proc_cgroup=proc, root=tmp_path / "cgroup", hostname="n")
    assert (limit.available, limit.source, limit.key) == (4 * GIB, "MemAvailable of the host", "n")


def test_no_limit_anywhere_means_the_host(tmp_path):
    proc = _v2(tmp_path, pod_max="max")
    assert cgroup_limits(proc, tmp_path / "cgroup") == []


def test_only_a_level_with_a_limit_has_its_usage_and_memory_stat_read(tmp_path, monkeypatch):
    """Every hook's preflight asks: a level without a limit costs one small read, not its long memory.stat."""
    import accelerate_memsafe.memory.limits as limits_mod

    read = []
    real = limits_mod._stat_value
    monkeypatch.setattr(limits_mod, "_stat_value", lambda path, keys: read.append(path.parent.name) or real(path, keys))
    assert cgroup_limits(_v2(tmp_path / "a", pod_max="max"), tmp_path / "a" / "cgroup") == [] and read == []
    assert len(cgroup_limits(_v2(tmp_path / "b", pod_max=str(8 * GIB)), tmp_path / "b" / "cgroup")) == 1
    assert read == ["kubepods"]  # the pod's level, not the leaf without a limit


def test_cgroup_v1_limit(tmp_path):
    root = tmp_path / "cgroup"
    group = root / "memory" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (group / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (group / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GIB // 2}\n")
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    proc = tmp_path / "cgroup_of_proc"
    proc.write_text("4:memory:/docker/abc\n0::/\n")
    limit = cpu_memory_limit(100 * GIB, proc_cgroup=proc, root=root, hostname="n")
    assert limit.available == 4 * GIB - GIB // 2
    assert "memory.limit_in_bytes of" in limit.source and limit.source.split(" of ")[1].startswith(str(group))


def _budget(rank, key, available, cpu, source="cgroup memory.max of /pod"):
    return RankBudget(rank, key, available, source, None, {"rank0_distribute": MemoryEstimate(cpu_bytes=cpu)})


def test_ranks_sharing_a_limit_are_summed_and_others_are_not():
    shared = [_budget(0, "a", 10 * GIB, 6 * GIB), _budget(1, "a", 10 * GIB, 5 * GIB)]
    problems = budget_problems("prepare", shared)
    assert len(problems) == 2 and all("the 2 ranks sharing this limit need 11.00 GiB together" in p for p in problems)
    assert "10.00 GiB available by the cgroup memory.max of /pod" in problems[0]
    apart = [_budget(0, "a", 10 * GIB, 6 * GIB), _budget(1, "b", 10 * GIB, 5 * GIB)]
    assert budget_problems("prepare", apart) == []


def test_without_a_process_group_a_rank_counts_its_local_world_size():
    alone = [_budget(0, "a", 10 * GIB, 6 * GIB, source="MemAvailable of the host")]
    assert budget_problems("prepare", alone, local_world_size=1) == []
    (problem,) = budget_problems("prepare", alone, local_world_size=2)
    assert "the 2 ranks sharing this limit need 12.00 GiB" in problem and "MemAvailable of the host" in problem
