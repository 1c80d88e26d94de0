"""`pdserve serve` hands every engine flag it was given to every engine child: parsed with a non-default
value for each flag the engine's settings declare, the children's command lines parse back to the same
settings, but for the per-child fields, each named with its reason."""

from __future__ import annotations

import argparse

from pdserve.api.flags import declared_flags, flag_values
from pdserve.api.roles import POOL_ROLES
from pdserve.cli import build_parser
from pdserve.cli.engine import ENGINE_SETTINGS
from pdserve.cli.serve import PER_CHILD, engine_child_argv


def _other_value(flag) -> list[str]:
    """Command-line words that set ``flag`` to something other than its default."""
    if flag.kind is bool:
        return [flag.option if not flag.default else "--no-" + flag.option[2:]]
    if flag.spec.choices:
        others = [choice for choice in flag.spec.choices if choice != flag.default]
        return [flag.option, others[0] if others else flag.spec.choices[0]]
    if flag.kind is str:  # a parsed one (--cuda-graph-sizes) takes numbers
        return [flag.option, "3" if flag.spec.parse is not None else "some-value"]
    base = flag.default if flag.default is not None else 1
    return [flag.option, str(flag.kind(base) + flag.kind(3))]


def _serve_args() -> argparse.Namespace:
    argv = ["serve"]
    for cls in ENGINE_SETTINGS:
        for flag in declared_flags(cls):
            argv += _other_value(flag)
    return build_parser().parse_args(argv)


def test_every_engine_flag_reaches_every_engine_child():
    parent = _serve_args()
    argv = engine_child_argv(parent)
    for role in POOL_ROLES:
        child = build_parser().parse_args([role.name, "--host", "127.0.0.1", "--port", "8100", *argv])
        for cls in ENGINE_SETTINGS:
            expected = flag_values(parent, cls, exclude=PER_CHILD)
            assert flag_values(child, cls, exclude=PER_CHILD) == expected, (role.name, cls.__name__)
        assert child.log_level == parent.log_level


def test_every_changed_flag_differs_from_its_default():
    """The test above would pass for a flag left at its default: check each one was changed."""
    parent = _serve_args()
    for cls in ENGINE_SETTINGS:
        for flag in declared_flags(cls):
            if not (flag.spec.choices and len(flag.spec.choices) == 1):  # one choice: nothing else to pick
                assert getattr(parent, flag.dest) != flag.default, flag.option


def test_per_child_fields_are_declared_flags():
    declared = {flag.field for cls in ENGINE_SETTINGS for flag in declared_flags(cls)}
    assert set(PER_CHILD) <= declared


def test_per_child_ports_stay_free_and_none_stays_none():
    parent = build_parser().parse_args(["serve", "--kv-events-port", "5557", "--kv-side-channel-port", "6000"])
    argv = engine_child_argv(parent)
    assert argv[argv.index("--kv-events-port") + 1] == "0" and "--kv-side-channel-port" not in argv
    argv = engine_child_argv(build_parser().parse_args(["serve", "--kv-events-port", "-1"]))
    assert argv[argv.index("--kv-events-port") + 1] == "-1"


def test_serve_schedules_by_priority_unless_told_otherwise():
    for given, expected in (([], "priority"), (["--scheduling-policy", "fcfs"], "fcfs")):
        parent = build_parser().parse_args(["serve", *given])
        assert parent.scheduling_policy == expected  # the colocated engine's
        child = build_parser().parse_args(["decode", *engine_child_argv(parent)])
        assert child.scheduling_policy == expected, given
