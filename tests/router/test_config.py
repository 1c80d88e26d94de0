"""Router settings read from the command line (``pdserve router``): ``--tier-weights`` parsed, defaulted and refused
with its reason."""

from __future__ import annotations

import re

import pytest

from pdserve.cli import build_parser
from pdserve.router.config import DEFAULT_TIER_WEIGHTS, RouterConfig, parse_tier_weights


def parsed(*argv: str) -> RouterConfig:
    args = build_parser().parse_args(["router", "--decode", "http://decode:8200", *argv])
    return RouterConfig.from_cli_args(args, api_key=None, keys_dir=None)


def test_tier_weights_default_and_parse():
    defaults = {"engine": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.4}
    assert parsed().tier_weights == DEFAULT_TIER_WEIGHTS and parsed().medium_weights == defaults
    assert RouterConfig([], ["a"]).medium_weights == defaults
    config = parsed("--tier-weights", "engine=1,host=0.9,disk=0.3,shared=0")
    assert config.medium_weights == {"engine": 1.0, "host": 0.9, "disk": 0.3, "shared": 0.0}
    # Media left out keep their default; spaces are fine; a tier may weigh as much as the pool.
    assert parse_tier_weights(" disk = 0.7 ") == {**defaults, "disk": 0.7}
    assert parse_tier_weights("host=1") == {**defaults, "host": 1.0}
    assert parse_tier_weights("engine=0.5,host=0.5,disk=0.25,shared=0.1")["engine"] == 0.5


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("tape=0.2", "unknown medium 'tape' (media: engine, host, disk, shared)"),
        ("disk", "'disk' is not medium=weight"),
        ("host=0.5,", "'' is not medium=weight"),
        ("disk=0.2,disk=0.3", "disk is given twice"),
        ("host=fast", "host's weight 'fast' is not a number"),
        ("disk=1.5", "disk's weight must be in [0, 1], got 1.5"),
        ("shared=-0.1", "shared's weight must be in [0, 1], got -0.1"),
        ("host=nan", "host's weight must be in [0, 1], got nan"),
        ("engine=0.6", "engine must weigh the most, got host above engine=0.6"),
        ("engine=0.3,host=0.2,disk=0.2,shared=0.4", "engine must weigh the most, got shared above engine=0.3"),
        ("engine=0,host=0,disk=0,shared=0", "engine must weigh more than 0"),
    ],
)
def test_tier_weights_are_refused_with_their_reason(text, reason, capsys):
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_tier_weights(text)
    with pytest.raises(ValueError, match=re.escape(reason)):
        RouterConfig([], ["a"], tier_weights=text)
    with pytest.raises(SystemExit):
        parsed("--tier-weights", text)
    assert f"argument --tier-weights: {reason}" in capsys.readouterr().err
