"""docs/config.md, "From the environment": ``KILNPROXY__<TABLE>__<KEY>=value`` sets any key of the config's
tables, on top of the file or of no file; a bad one is refused in one line naming the variable.

The keys are learnt from the loader itself (``Config.settings``: every key it read outside the arrays of
tables, with where its value came from), and checked against docs/config.md's tables."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from kilnproxy.config import load_config, parse_config
from kilnproxy.config_env import variable
from kilnproxy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DOC = ROOT / "docs" / "config.md"
GOOD = """
[[models]]
id = "m"
upstreams = ["http://127.0.0.1:8000/v1"]
[[orgs]]
id = "acme"
[[keys]]
key = "sk-1"
org = "acme"
"""
# A value for each key whose default is none (so that nothing can be derived from it), as the variable's text.
EXAMPLES = {
    "storage.url": "postgresql://kiln:pw@db.internal:5432/kiln",
    "storage.url_env": "KILNPROXY_TEST_DATABASE_URL",
    "admin.token": "adm-token",
    "admin.token_sha256": "ab" * 32,
    "inspector.token": "insp-token",
    "tracing.headers_env": "KILNPROXY_TEST_OTLP_HEADERS",
    "tracing.trace_url": "https://grafana.example/explore?traceId={trace_id}",
}
EXAMPLE_ENVIRONMENT = {"KILNPROXY_TEST_DATABASE_URL": "postgresql://kiln:pw@db.internal:5432/kiln",
                       "KILNPROXY_TEST_OTLP_HEADERS": "x-api-key=k"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kiln.toml"
    path.write_text(text)
    return path


def documented_tables() -> dict[str, set[str]]:
    """docs/config.md's tables outside arrays of tables (``### `[server]` ``, not ``[[models]]`` nor
    ``[models.pricing]``) -> the keys of their rows."""
    text = CONFIG_DOC.read_text(encoding="utf-8")
    headings = list(re.finditer(r"^#+ .*?`(\[\[?)([\w.]+)\]?\]`.*$", text, re.M))
    arrays = {h.group(2) for h in headings if h.group(1) == "[["}
    tables: dict[str, set[str]] = {}
    for i, heading in enumerate(headings):
        name = heading.group(2)
        if name in arrays or name.split(".")[0] in arrays:
            continue
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        keys = tables.setdefault(name, set())
        for line in text[heading.end():end].splitlines():
            if line.startswith("|") and not set(line) <= set("|-: "):
                keys.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return tables


def another_value(key: str, default):
    """The variable's text for ``key``, a value other than its default, and that value as TOML reads it."""
    if key in EXAMPLES:
        return EXAMPLES[key], EXAMPLES[key]
    if isinstance(default, bool):
        return ("false", False) if default else ("true", True)
    if isinstance(default, int):
        return str(default + 1), default + 1
    if isinstance(default, float):
        value = default / 2 if default else 1.5
        return repr(value), value
    if isinstance(default, str):
        return default + "-env", default + "-env"
    if isinstance(default, (list, tuple)):
        return '["env-plugin"]', ["env-plugin"]
    if isinstance(default, dict):
        return '{env = {a = 1}}', {"env": {"a": 1}}
    raise AssertionError(f"{key}: no example value for its variable: add one to EXAMPLES")


def test_every_documented_key_outside_arrays_of_tables_is_covered_by_the_rule():
    read = parse_config({}).settings  # every key the loader read, learnt from the loader itself
    assert {"server.port", "storage.url_env", "admin.token", "tracing.trace_url"} <= set(read), sorted(read)
    documented = {f"{table}.{key}" for table, keys in documented_tables().items() for key in keys}
    assert {"server.port", "storage.path", "inspector.capture"} <= documented, "update documented_tables()"
    not_covered = sorted(documented - set(read))
    assert not not_covered, f"keys docs/config.md lists that no KILNPROXY__ variable reaches: {not_covered}"
    for key in sorted(documented):
        table, name = key.split(".")
        text, value = another_value(key, read[key][1])
        config = load_config(None, {variable(table, name): text, **EXAMPLE_ENVIRONMENT})
        assert config.settings[key] == (variable(table, name), value), key
        section = getattr(config, table)
        if hasattr(section, name):
            expected = tuple(value) if isinstance(value, list) else value
            assert getattr(section, name) == expected, key


def test_the_variable_names_table_and_key_in_capitals():
    assert variable("server", "port") == "KILNPROXY__SERVER__PORT"
    assert variable("storage", "url_env") == "KILNPROXY__STORAGE__URL_ENV"


def test_a_variable_wins_over_the_file_and_the_rest_keeps_its_origin(tmp_path):
    path = write(tmp_path, '[server]\nport = 9001\nhost = "0.0.0.0"\n' + GOOD)
    config = load_config(path, {"KILNPROXY__SERVER__PORT": "9002", "KILNPROXY__LOG__BODIES": "true"})
    assert (config.server.port, config.server.host, config.log.bodies) == (9002, "0.0.0.0", True)
    assert config.settings["server.port"] == ("KILNPROXY__SERVER__PORT", 9002)
    assert config.settings["server.host"] == ("file", "0.0.0.0")
    assert config.settings["log.bodies"] == ("KILNPROXY__LOG__BODIES", True)
    assert config.settings["log.access"] == ("default", True)
    assert [m.id for m in config.models] == ["m"] and config.keys[0].org == "acme"


def test_no_file_at_all_gives_the_defaults_with_the_variables_on_top(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, {"KILNPROXY__STORAGE__PATH": "ledger.db", "KILNPROXY__HEALTH__INTERVAL": "0",
                                "KILNPROXY__TRACING__SAMPLE_RATIO": "0.25", "PATH": "/usr/bin"})
    assert config.source == "<environment>" and config.models == ()
    assert config.db_path == tmp_path / "ledger.db"  # relative to the working folder, there being no file
    assert (config.health.interval, config.tracing.sample_ratio) == (0.0, 0.25)
    assert config.server.port == 8080


def test_a_string_key_takes_the_text_as_written_every_other_key_as_toml():
    config = load_config(None, {"KILNPROXY__MAINTENANCE__RETRY_AFTER": "120",
                                "KILNPROXY__SERVER__HOST": "0.0.0.0",
                                "KILNPROXY__SERVER__DRAIN_SECONDS": "12",
                                "KILNPROXY__PLUGINS__MODULES": '["plugins/redact.py", "mypkg.plugin"]',
                                "KILNPROXY__PLUGINS__SETTINGS": '{redact = {patterns = ["sk-[a-z]+"]}}',
                                "KILNPROXY__INSPECTOR__CAPTURE": "true"})
    assert config.maintenance.retry_after == "120"
    assert config.server.host == "0.0.0.0"
    assert config.server.drain_seconds == 12.0
    assert config.plugins.modules == ("plugins/redact.py", "mypkg.plugin")
    assert config.plugins.settings == {"redact": {"patterns": ["sk-[a-z]+"]}}
    assert config.inspector.capture is True


def test_url_env_from_the_environment_reads_the_url_from_the_variable_it_names():
    config = load_config(None, {"KILNPROXY__STORAGE__URL_ENV": "DATABASE_URL",
                                "DATABASE_URL": "postgresql://kiln:pw@db:5432/kiln"})
    assert config.storage.url == "postgresql://kiln:pw@db:5432/kiln"
    assert config.storage.url_env == "DATABASE_URL"


@pytest.mark.parametrize("environ, message", [
    ({"KILNPROXY__SERVER__PORT": "99999"}, "KILNPROXY__SERVER__PORT: server.port: must be between 0 and 65535, got 99999"),
    ({"KILNPROXY__SERVER__PORT": "80a"}, "KILNPROXY__SERVER__PORT: server.port: must be an integer, got '80a'"),
    ({"KILNPROXY__SERVER__PORT": '"80"'}, "KILNPROXY__SERVER__PORT: server.port: must be an integer, got str '80'"),
    ({"KILNPROXY__SERVER__PORT": "true"}, "KILNPROXY__SERVER__PORT: server.port: must be an integer, got True"),
    ({"KILNPROXY__SERVER__DRAIN_SECONDS": "-1"},
     "KILNPROXY__SERVER__DRAIN_SECONDS: server.drain_seconds: must be 0 (stop listening at once) or more, got -1"),
    ({"KILNPROXY__SERVER__KEEPALIVE_SECONDS": "nan"},
     "KILNPROXY__SERVER__KEEPALIVE_SECONDS: server.keepalive_seconds: must be a finite number, got nan"),
    ({"KILNPROXY__SERVER__KEEPALIVE_SECONDS": "soon"},
     "KILNPROXY__SERVER__KEEPALIVE_SECONDS: server.keepalive_seconds: must be a number, got 'soon'"),
    ({"KILNPROXY__LOG__ACCESS": "yes"}, "KILNPROXY__LOG__ACCESS: log.access: must be true or false, got 'yes'"),
    ({"KILNPROXY__LOG__ACCESS": "1"}, "KILNPROXY__LOG__ACCESS: log.access: must be true or false, got int 1"),
    ({"KILNPROXY__SERVER__PROT": "1"},
     "KILNPROXY__SERVER__PROT: server.prot: unknown key (check its spelling against config.example.toml)"),
    ({"KILNPROXY__SERVR__PORT": "1"},
     "KILNPROXY__SERVR__PORT: servr: unknown table (check its spelling against config.example.toml)"),
    ({"KILNPROXY__MODELS__ID": "m"},
     "KILNPROXY__MODELS__ID: [[models]] is an array of tables: it stays in the config file"),
    ({"KILNPROXY__SERVER": "x"},
     "KILNPROXY__SERVER: not a config key: the rule is KILNPROXY__<TABLE>__<KEY>, e.g. KILNPROXY__SERVER__PORT=8080"),
    ({"KILNPROXY__PLUGINS__SETTINGS__REDACT": "{}"}, "KILNPROXY__PLUGINS__SETTINGS__REDACT: not a config key: "
     "the rule is KILNPROXY__<TABLE>__<KEY>, e.g. KILNPROXY__SERVER__PORT=8080"),
    ({"KILNPROXY__PLUGINS__MODULES": "plugins/redact.py"},
     "KILNPROXY__PLUGINS__MODULES: plugins.modules: must be a TOML array, e.g. [\"a\", \"b\"]"),
    ({"KILNPROXY__PLUGINS__SETTINGS": "{token = 's3cret'"},
     "KILNPROXY__PLUGINS__SETTINGS: plugins.settings: must be a TOML inline table, e.g. {a = 1}"),
    ({"KILNPROXY__ADMIN__TOKEN": " "}, "KILNPROXY__ADMIN__TOKEN: admin.token: must not be empty"),
    ({"KILNPROXY__PLUGINS__SETTINGS": "{redact = 1}"},
     "KILNPROXY__PLUGINS__SETTINGS: plugins.settings.redact: must be a table"),
    ({"KILNPROXY__STORAGE__URL": "mysql://u:s3cret@h/db"},
     "KILNPROXY__STORAGE__URL: storage.url: must be a postgresql:// URL, got scheme 'mysql'"),
    ({"KILNPROXY__STORAGE__URL_ENV": "KILNPROXY_TEST_NOT_SET"},
     "KILNPROXY__STORAGE__URL_ENV: storage.url_env: the environment variable KILNPROXY_TEST_NOT_SET is not set or "
     "empty"),
    ({"KILNPROXY__MAINTENANCE__RETRY_AFTER": "1\r\nX-Evil: 1"},
     "KILNPROXY__MAINTENANCE__RETRY_AFTER: maintenance.retry_after: must not hold a control character (it is "
     "sent as an HTTP header), got '1\\r\\nX-Evil: 1'"),
])
def test_a_bad_variable_is_one_line_naming_it(tmp_path, environ, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, GOOD), environ)
    assert str(info.value) == message
    assert "s3cret" not in str(info.value)
    with pytest.raises(ConfigError) as info:  # the same with no file
        load_config(None, environ)
    assert str(info.value) == message


def test_the_file_value_is_still_named_by_the_file_when_another_key_comes_from_the_environment(tmp_path):
    path = write(tmp_path, "[server]\nport = 70000\n" + GOOD)
    with pytest.raises(ConfigError) as info:
        load_config(path, {"KILNPROXY__SERVER__HOST": "0.0.0.0"})
    assert str(info.value) == f"{path}: server.port: must be between 0 and 65535, got 70000"


def test_a_variable_fixes_a_file_value_it_replaces(tmp_path):
    path = write(tmp_path, "[server]\nport = 70000\n" + GOOD)
    assert load_config(path, {"KILNPROXY__SERVER__PORT": "8081"}).server.port == 8081


def test_a_file_error_comes_first_and_names_the_file(tmp_path):
    path = write(tmp_path, "[server]\nprot = 1\n" + GOOD)
    with pytest.raises(ConfigError) as info:
        load_config(path, {"KILNPROXY__SERVER__PROTT": "1"})
    assert str(info.value) == f"{path}: server.prot: unknown key (check its spelling against config.example.toml)"


def test_parse_config_alone_reads_no_environment(monkeypatch):
    monkeypatch.setenv("KILNPROXY__SERVER__PORT", "9005")
    assert parse_config({}).server.port == 8080  # what the test harness and the tests build: the file alone
    assert load_config(None).server.port == 9005  # load_config reads the process's own environment


def test_the_example_file_with_the_environment_on_top():
    environ = {"KILNPROXY__SERVER__HOST": "0.0.0.0", "KILNPROXY__STORAGE__PATH": "/data/kilnproxy.db"}
    config = load_config(ROOT / "config.example.toml", environ)
    raw = tomllib.loads((ROOT / "config.example.toml").read_text())
    assert config.server.host == "0.0.0.0" and str(config.db_path) == "/data/kilnproxy.db"
    assert config.server.port == raw["server"]["port"]
    assert len(config.models) == len(raw["models"])


@pytest.mark.parametrize("key, value, shown", [
    ("storage.url", "postgresql://kiln:pw-1@db:5432/kiln?sslmode=require&password=pw-2",
     '"postgresql://kiln:***@db:5432/kiln?sslmode=require&password=***"'),
    ("storage.url", "postgresql://db:5432/kiln", '"postgresql://db:5432/kiln"'),
    ("storage.url", None, "none"),
    ("admin.token", "pw-3", "<secret>"),
    ("admin.token_sha256", "ab" * 32, "<secret>"),
    ("inspector.token", "pw-4", "<secret>"),
    ("plugins.settings", {"webhook": {"url": "https://h/pw-5"}, "my plugin": {}}, '{webhook = {...}, "my plugin" = {...}}'),
    ("plugins.modules", ("a.py", "b"), '["a.py", "b"]'),
    ("server.port", 8080, "8080"),
    ("log.bodies", False, "false"),
])
def test_check_config_shows_a_value_but_never_a_secret(key, value, shown):
    from kilnproxy.cli.settings_text import shown as show
    assert show(key, value) == shown
