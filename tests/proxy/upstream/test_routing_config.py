"""SPEC 13's keys on [[models]]: ``routing``, ``cache_aware_slack``, ``load_poll``; their defaults, their
one-line errors, and ``routing`` in ``check-config``'s output."""

import subprocess
import sys

import pytest
from processes import gateway_config, toml

from kilnproxy.config import parse_config
from kilnproxy.errors import ConfigError

BASE = {"id": "m", "upstreams": ["http://127.0.0.1:1/v1"]}


def model_of(**extra):
    return parse_config({"models": [{**BASE, **extra}]}, source="c.toml").models[0]


def test_defaults():
    m = model_of()
    assert (m.routing, m.cache_aware_slack, m.load_poll) == ("least_busy", 0.25, 1.0)


def test_values_taken():
    m = model_of(routing="cache_aware", cache_aware_slack=0, load_poll=0.5)
    assert (m.routing, m.cache_aware_slack, m.load_poll) == ("cache_aware", 0.0, 0.5)
    assert model_of(routing="round_robin", load_poll=0).load_poll == 0.0
    assert model_of(cache_aware_slack=2).cache_aware_slack == 2.0


@pytest.mark.parametrize("extra, message", [
    ({"routing": "random"}, "models[0] (m).routing: unknown routing 'random'; choose from least_busy, cache_aware,"
                            " round_robin"),
    ({"routing": 1}, "models[0] (m).routing: must be"),
    ({"cache_aware_slack": -0.1}, "models[0] (m).cache_aware_slack: must be 0 or more, got -0.1"),
    ({"cache_aware_slack": float("nan")}, "models[0] (m).cache_aware_slack: must be a finite number"),
    ({"cache_aware_slack": "0.2"}, "models[0] (m).cache_aware_slack: must be"),
    ({"load_poll": -1}, "models[0] (m).load_poll: must be 0 (no reads) or more seconds, got -1"),
    ({"load_poll": float("inf")}, "models[0] (m).load_poll: must be a finite number"),
    ({"load_poll": True}, "models[0] (m).load_poll: must be"),
])
def test_errors_name_the_key_on_one_line(extra, message):
    with pytest.raises(ConfigError) as caught:
        model_of(**extra)
    text = str(caught.value)
    assert text.startswith(f"c.toml: {message}"), text
    assert "\n" not in text


def test_check_config_prints_the_routing(tmp_path):
    config = gateway_config(["http://10.0.0.7:8000/v1", "http://10.0.0.8:8000/v1"])
    config["models"][0]["routing"] = "cache_aware"
    config["models"].append({"id": "other", "upstreams": ["http://10.0.0.9:8000/v1"]})
    path = tmp_path / "gw.toml"
    path.write_text(toml(config))
    out = subprocess.run([sys.executable, "-m", "kilnproxy", "check-config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stderr) == (0, "")
    lines = [line for line in out.stdout.splitlines() if line.startswith("  model ")]
    assert lines == ["  model    test-model -> org/Test-Model-7B via http://10.0.0.7:8000/v1, http://10.0.0.8:8000/v1,"
                     " routing cache_aware",
                     "  model    other -> other via http://10.0.0.9:8000/v1, routing least_busy"]
