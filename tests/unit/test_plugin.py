"""MemSafePlugin: validation at construction, options, from_env/to_env."""

from __future__ import annotations

import pytest

from accelerate_memsafe import ConfigError, MemSafePlugin, PipelineError
from accelerate_memsafe.pipeline import Stage, validate_stage_names
from accelerate_memsafe.plugin import parse_size
from accelerate_memsafe.stages import DEFAULT_STAGES, STAGE_REGISTRY


def test_default_pipeline_enables_every_stage():
    plugin = MemSafePlugin()
    enabled = {name for hook in ("prepare", "load_state", "save_state", "save_model") for name in plugin.stage_names(hook)}
    assert enabled == set(STAGE_REGISTRY) == set(DEFAULT_STAGES)


def test_unknown_and_duplicate_stage_names_are_all_reported():
    with pytest.raises(PipelineError) as info:
        MemSafePlugin(stages=["shard", "bogus", "also_bogus", "shard"])
    msg = str(info.value)
    assert "`bogus`" in msg and "`also_bogus`" in msg and "listed twice" in msg
    assert len(info.value.problems) == 3
    assert "Available names:" in msg


def test_stages_as_a_string_is_rejected():
    with pytest.raises(PipelineError, match="list of stage names"):
        MemSafePlugin(stages="shard")


class _A(Stage):
    name = "a"
    hooks = ("prepare",)


class _B(Stage):
    name = "b"
    hooks = ("prepare",)
    requires = ("a",)


class _C(Stage):
    name = "c"
    hooks = ("prepare", "save_state")
    run_before = ("a",)


_REG = {"a": _A, "b": _B, "c": _C}


def test_order_requirements_are_checked_and_every_problem_listed():
    with pytest.raises(PipelineError) as info:
        validate_stage_names(["b", "a", "c"], _REG)
    problems = info.value.problems
    assert any("`b` requires `a`" in p and "move `a` before `b`" in p for p in problems)
    assert any("`c` must run before `a`" in p for p in problems)
    assert len(problems) == 2


def test_missing_requirement_names_the_fix():
    with pytest.raises(PipelineError, match="add `a` before `b`"):
        validate_stage_names(["b"], _REG)


def test_valid_order_splits_by_hook():
    by_hook = validate_stage_names(["c", "a", "b"], _REG)
    assert [s.name for s in by_hook["prepare"]] == ["c", "a", "b"]
    assert [s.name for s in by_hook["save_state"]] == ["c"]
    assert by_hook["load_state"] == ()


def test_real_stage_requirements_are_enforced():
    for name, cls in STAGE_REGISTRY.items():
        for req in cls.requires:
            order = [n for n in DEFAULT_STAGES if n != req]
            with pytest.raises(PipelineError, match=f"`{name}` requires `{req}`"):
                MemSafePlugin(stages=order)


def test_sizes_parse_like_transformers():
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert MemSafePlugin(bucket_bytes="1MiB").bucket_bytes == 2**20
    with pytest.raises(ConfigError, match="bucket_bytes"):
        MemSafePlugin(bucket_bytes=0)
    with pytest.raises(ConfigError, match="is not a size|unknown unit"):
        parse_size("12XB")


def test_bad_option_values_are_reported():
    with pytest.raises(ConfigError, match="prefetch_buckets"):
        MemSafePlugin(prefetch_buckets=0)
    with pytest.raises(ConfigError, match="collective_timeout_s"):
        MemSafePlugin(collective_timeout_s=-1)


def test_from_env_reads_every_option_and_to_env_round_trips():
    env = {
        "ACCELERATE_MEMSAFE_STAGES": "shard",
        "ACCELERATE_MEMSAFE_BUCKET_BYTES": "32MiB",
        "ACCELERATE_MEMSAFE_PREFETCH_BUCKETS": "3",
        "ACCELERATE_MEMSAFE_OPTIMIZER_OFFLOAD": "true",
        "ACCELERATE_MEMSAFE_COLLECTIVE_TIMEOUT_S": "12.5",
        "ACCELERATE_MEMSAFE_REPORT_PATH": "/tmp/r-{rank}.json",
    }
    plugin = MemSafePlugin.from_env(env)
    assert plugin.stages == ("shard",)
    assert plugin.bucket_bytes == 32 * 2**20
    assert plugin.prefetch_buckets == 3
    assert plugin.optimizer_offload is True
    assert plugin.collective_timeout_s == 12.5
    assert plugin.report_path == "/tmp/r-{rank}.json"
    again = MemSafePlugin.from_env(plugin.to_env())
    assert again == plugin


def test_from_env_rejects_unknown_variables_and_bad_values():
    with pytest.raises(ConfigError, match="ACCELERATE_MEMSAFE_BUKET_BYTES"):
        MemSafePlugin.from_env({"ACCELERATE_MEMSAFE_BUKET_BYTES": "1"})
    with pytest.raises(ConfigError, match="not a boolean"):
        MemSafePlugin.from_env({"ACCELERATE_MEMSAFE_OPTIMIZER_OFFLOAD": "maybe"})
    with pytest.raises(PipelineError, match="unknown stage `nope`"):
        MemSafePlugin.from_env({"ACCELERATE_MEMSAFE_STAGES": "shard,nope"})


def test_plugin_is_frozen():
    plugin = MemSafePlugin()
    with pytest.raises(Exception):
        plugin.bucket_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize("stages", [["meta_placement", "shard"], ["meta_placement"], ["meta_placement", "shard", "buffer_init"]])
def test_stages_that_would_leave_weights_on_meta_are_refused(stages):
    # before: MemSafePlugin(stages=["meta_placement", "shard"]) was accepted and every weight stayed on meta
    with pytest.raises(PipelineError, match="`meta_placement` needs .*`rank0_distribute` after it"):
        MemSafePlugin(stages=stages)


def test_every_stage_that_needs_a_later_stage_is_refused_without_it():
    for name, cls in STAGE_REGISTRY.items():
        for later in cls.completed_by:
            order = [n for n in DEFAULT_STAGES if n != later]
            with pytest.raises(PipelineError, match=f"`{name}` needs"):
                MemSafePlugin(stages=order)
