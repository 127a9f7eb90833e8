"""Each `serve` default is stated once, in the daemon's configuration dataclass: every option of
both `serve` commands shows the default of the field it sets (in the option's unit), so changing
either side alone fails here, naming the option."""

import dataclasses

import pytest

from starsd_draftd import cli as draftd_cli
from starsd_draftd.app import ServeConfig
from starsd_target import cli as target_cli
from starsd_target.config import TargetConfig

# options that set no field: logging is set up before any configuration is built, and --no-draft
# is the target's draft endpoint set to None
NOT_FIELDS = {"log_level", "log_format"}
SERVES = {
    "starsd-draftd": (draftd_cli.main.commands["serve"], (draftd_cli.SERVE_OPTIONS, draftd_cli.SERVER_OPTIONS),
                      NOT_FIELDS),
    "starsd-target": (target_cli.main.commands["serve"], (target_cli.CONFIG_OPTIONS,), NOT_FIELDS | {"no_draft"}),
}


def _field_default(cls, name: str):
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@pytest.mark.parametrize("daemon", sorted(SERVES))
def test_every_serve_option_shows_its_fields_default(daemon):
    command, configs, not_fields = SERVES[daemon]
    seen = set()
    for param in command.params:
        option = param.opts[0]
        assert param.show_default, f"{daemon} serve {option}: --help does not show its default"
        owners = [c for c in configs if c.field(param.name) is not None]
        if param.name in not_fields:
            assert owners == [], f"{daemon} serve {option} sets a field after all"
            continue
        assert len(owners) == 1, f"{daemon} serve {option} sets {len(owners)} configuration fields, not one"
        name, unit = owners[0].field(param.name)
        field_default = _field_default(owners[0].cls, name)
        expected = field_default if unit is None else unit.to_option(field_default)
        assert param.default == expected and type(param.default) is type(expected), \
            f"{daemon} serve {option}: default {param.default!r}, but {owners[0].cls.__name__}.{name} " \
            f"defaults to {field_default!r} ({expected!r} in the option's unit)"
        seen.add((owners[0].cls, name))
    assert seen  # the walk did compare


def test_a_configuration_built_in_code_drafts_trees_as_the_command_line_does():
    assert ServeConfig().tree_topk == 8


def test_the_lower_layers_take_the_configurations_defaults():
    import inspect

    from starsd_target.engine import TargetEngine
    from starsd_target.scheduler import Scheduler

    engine = inspect.signature(TargetEngine).parameters
    assert engine["depth"].default == TargetConfig.depth and engine["prefill_chunk"].default == TargetConfig.prefill_chunk
    sched = inspect.signature(Scheduler).parameters
    for param, field in [("max_active", "max_active"), ("max_queue", "max_queue"), ("heartbeat_s", "heartbeat_s"),
                         ("stall_s", "stall_timeout_s"), ("adaptive_depth", "adaptive_depth"),
                         ("pause_unpaid_drafts", "pause_unpaid_drafts"),
                         ("admit_window_s", "admit_window_s")]:
        assert sched[param].default == _field_default(TargetConfig, field), param


def test_units_convert_both_ways():
    for options, option, value, field_value in [(draftd_cli.SERVER_OPTIONS, "batch_window_ms", 2.0, 0.002),
                                                (draftd_cli.SERVER_OPTIONS, "max_kv_mib", 3, 3 << 20),
                                                (target_cli.CONFIG_OPTIONS, "admit_window_ms", 5.0, 0.005),
                                                (target_cli.CONFIG_OPTIONS, "draft_max_active", None, None)]:
        name, _ = options.field(option)
        assert options.values({option: value, "other": 1}) == {name: field_value}
