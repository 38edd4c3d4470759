"""docs/config.md: the config is validated once; a bad one is one line naming file, key and problem."""

import subprocess
import sys
from pathlib import Path

import pytest

from kilnproxy.config import load_config, sha256_hex
from kilnproxy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
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


def write(tmp_path, text):
    path = tmp_path / "kiln.toml"
    path.write_text(text)
    return path


def test_example_config_loads_with_every_documented_key():
    config = load_config(ROOT / "config.example.toml")
    assert config.server.port == 8080 and config.server.max_request_bytes == 4194304
    assert config.models[0].upstream_model == "Qwen/Qwen3-32B"
    assert config.models[0].pricing.cached_prompt == 0.05
    assert config.keys[0].key_sha256 == sha256_hex("sk-acme-dev")


def test_defaults_fill_every_key(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    s = config.server
    assert (s.host, s.port, s.max_request_bytes, s.keepalive_seconds, s.upstream_connect_timeout,
            s.upstream_idle_timeout) == ("127.0.0.1", 8080, 4194304, 15, 10, 600)
    assert config.limits.max_in_flight_per_org == 8
    assert config.maintenance.enabled is False
    assert config.db_path == tmp_path / "kilnproxy.db"  # relative to the config file
    model = config.models[0]
    assert model.upstream_model == "m" and model.reject_chat_params == ()
    assert model.pricing.cost(1_000_000, 0, 500_000) == 0  # no pricing: free
    key = config.keys[0]
    assert key.models is None and key.disabled is False and key.role == "member" and key.id.startswith("key-")
    assert "sk-1" not in key.id


@pytest.mark.parametrize("text, needle", [
    ("[server]\nprot = 1\n" + GOOD, "server.prot: unknown key"),
    ("[server]\nport = \"80\"\n" + GOOD, "server.port: must be an integer"),
    ("[server]\nkeepalive_seconds = 0\n" + GOOD, "server.keepalive_seconds: must be greater than 0"),
    ("[limits]\nmax_in_flight_per_org = true\n" + GOOD, "limits.max_in_flight_per_org: must be an integer"),
    (GOOD.replace('upstreams = ["http://127.0.0.1:8000/v1"]', "upstreams = []"), "upstreams: a model needs"),
    (GOOD.replace('upstreams = ["http://127.0.0.1:8000/v1"]', 'upstreams = ["localhost:8000"]'),
     "is not an http(s) base URL"),
    (GOOD.replace('org = "acme"', 'org = "nobody"'), "keys[0].org: org 'nobody' does not exist"),
    (GOOD + '[[keys]]\nkey = "sk-1"\norg = "acme"\n', "keys[1]: the same key is listed twice"),
    (GOOD.replace('key = "sk-1"', 'key_sha256 = "abc"'), "keys[0].key_sha256: must be 64 hex digits"),
    (GOOD.replace('key = "sk-1"', 'key = "sk-1"\nrole = "owner"'),
     'keys[0].role: must be "admin" or "member", got \'owner\''),
    (GOOD.replace('key = "sk-1"', 'key = "sk-1"\nrole = true'), "keys[0].role: must be a string, got True"),
    (GOOD + "[[models]]\nid = \"m\"\nupstreams = [\"http://x/v1\"]\n", "models.id: 'm' is defined twice"),
    (GOOD + "[models.pricing]\nprompt = -1\n", "pricing.prompt: must not be negative"),
    # A finite price or credit so large that a cost or a sum with grants overflows a double to inf
    (GOOD + "[models.pricing]\ncompletion = 1e308\n",
     "models[0] (m).pricing.completion: must be at most 1,000,000,000,000 USD, got 1e+308"),
    (GOOD + "[models.pricing]\ncached_prompt = 1e13\n", "pricing.cached_prompt: must be at most 1,000,000,000,000 USD"),
    (GOOD.replace('id = "acme"', 'id = "acme"\ncredits = -5'), "orgs[0].credits: must not be negative, got -5"),
    (GOOD.replace('id = "acme"', 'id = "acme"\ncredits = 1.7e308'),
     "orgs[0].credits: must be at most 1,000,000,000,000 USD, got 1.7e+308"),
    ("[[models]]\nupstreams = [\"http://x/v1\"]\n", "models[0].id: is required"),
    ("this is = not toml =", "not valid TOML"),
    ('[storage]\nurl = "postgresql://a@b/c"\nurl_env = "X"\n' + GOOD, "storage.url: give url or url_env, not both"),
    ('[storage]\nurl = "mysql://a:pw@b/c"\n' + GOOD, "storage.url: must be a postgresql:// URL, got scheme 'mysql'"),
    ('[storage]\nurl_env = "KILNPROXY_TEST_UNSET_URL"\n' + GOOD,
     "storage.url_env: the environment variable KILNPROXY_TEST_UNSET_URL is not set or empty"),
    ("[server]\ndrain_seconds = -1\n" + GOOD, "server.drain_seconds: must be 0 (stop listening at once) or more"),
    ("[tracing]\nendpoint = \"collector:4318\"\n" + GOOD, "tracing.endpoint: must be an http(s) URL"),
    ("[tracing]\nsample_ratio = 1.5\n" + GOOD, "tracing.sample_ratio: must be between 0 and 1, got 1.5"),
    ("[tracing]\nservice_name = \" \"\n" + GOOD, "tracing.service_name: must not be empty"),
    ("[tracing]\nenable = true\n" + GOOD, "tracing.enable: unknown key"),
    ("[storage]\nreplica_timeout_seconds = 0\n" + GOOD, "storage.replica_timeout_seconds: must be greater than 0"),
])
def test_bad_config_is_one_clear_error(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize("table, name", [
    ("[server]", "keepalive_seconds"), ("[server]", "upstream_connect_timeout"), ("[server]", "drain_seconds"),
    ("[storage]", "replica_timeout_seconds"), ("[health]", "interval"), ("[tracing]", "sample_ratio"),
    ("[[models]]\nid = \"n\"\nupstreams = [\"http://x/v1\"]", "first_byte_timeout"),
    ("[[models]]\nid = \"n\"\nupstreams = [\"http://x/v1\"]", "queue_timeout"),
    ("[[models]]\nid = \"n\"\nupstreams = [\"http://x/v1\"]\n[models.pricing]", "cached_prompt"),
    ("[[orgs]]\nid = \"beta\"", "credits"),
])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_number_setting_refuses_nan_and_infinity(tmp_path, table, name, value):
    path = write(tmp_path, f"{GOOD}{table}\n{name} = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).endswith(f".{name}: must be a finite number, got {value}")


UPSTREAM = 'upstreams = ["http://127.0.0.1:8000/v1"]'


@pytest.mark.parametrize("text, needle", [
    (GOOD.replace(UPSTREAM, 'upstreams = ["http://[::1/v1"]'),
     "models[0] (m).upstreams: 'http://[::1/v1' is not a valid URL: Invalid IPv6 URL"),
    (GOOD.replace(UPSTREAM, 'upstreams = [{url = "http://[zz/v1"}]'),
     "models[0] (m).upstreams: 'http://[zz/v1' is not a valid URL: Invalid IPv6 URL"),
    (GOOD.replace(UPSTREAM, 'upstreams = ["http://127.0.0.1:99999/v1"]'),
     "models[0] (m).upstreams: 'http://127.0.0.1:99999/v1' is not a valid URL: Port out of range 0-65535"),
    (GOOD.replace(UPSTREAM, 'upstreams = ["http://h:abc/v1"]'),
     "models[0] (m).upstreams: 'http://h:abc/v1' is not a valid URL: Port could not be cast to integer value"),
    ('[tracing]\nendpoint = "http://[::1/v1/traces"\n' + GOOD,
     "tracing.endpoint: 'http://[::1/v1/traces' is not a valid URL: Invalid IPv6 URL"),
    ('[tracing]\ntrace_url = "http://[::1/{trace_id}"\n' + GOOD,
     "tracing.trace_url: 'http://[::1/{trace_id}' is not a valid URL: Invalid IPv6 URL"),
    ('[storage]\nurl = "postgresql://kiln:hunter2@[::1/kiln"\n' + GOOD,
     "storage.url: is not a valid URL: Invalid IPv6 URL"),
])
def test_a_url_with_a_malformed_host_or_port_is_one_line(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: {needle}")
    assert "\n" not in str(info.value) and "hunter2" not in str(info.value)


def test_a_database_url_may_list_several_hosts(tmp_path):
    path = write(tmp_path, '[storage]\nurl = "postgresql://kiln@db1:5432,db2:5433/kiln"\n' + GOOD)
    assert load_config(path).storage.url == "postgresql://kiln@db1:5432,db2:5433/kiln"


@pytest.mark.parametrize("toml_value, shown", [(r'"a\nb"', r"'a\nb'"), (r'"120\r"', r"'120\r'"),
                                               (r'"x\u007f"', r"'x\x7f'")])
def test_a_header_setting_refuses_a_control_character(tmp_path, toml_value, shown):
    path = write(tmp_path, f"[maintenance]\nenabled = true\nretry_after = {toml_value}\n{GOOD}")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: maintenance.retry_after: must not hold a control character (it is sent "
                               f"as an HTTP header), got {shown}")


def test_a_tracing_header_refuses_a_control_character(tmp_path, monkeypatch):
    monkeypatch.setenv("KILNPROXY_TEST_OTLP", "x-api-key=s3\ncret")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, '[tracing]\nheaders_env = "KILNPROXY_TEST_OTLP"\n' + GOOD))
    assert str(info.value).endswith("tracing.headers_env: the variable KILNPROXY_TEST_OTLP holds a control "
                                    "character in header 'x-api-key' (the value is not shown)")
    assert "s3" not in str(info.value)


@pytest.mark.parametrize("name", ["a b", "x:y", "caf\u00e9"])
def test_a_tracing_header_name_must_be_an_http_token(tmp_path, monkeypatch, name):
    """Else every export is refused by the receiver (and every span dropped) while the config said OK."""
    monkeypatch.setenv("KILNPROXY_TEST_OTLP", f"{name}=v")
    with pytest.raises(ConfigError, match="tracing.headers_env: .* not an HTTP header name"):
        load_config(write(tmp_path, '[tracing]\nheaders_env = "KILNPROXY_TEST_OTLP"\n' + GOOD))


def test_bad_config_stops_start_up_with_one_line_and_no_traceback(tmp_path):
    path = write(tmp_path, GOOD.replace('org = "acme"', 'org = "nobody"'))
    proc = subprocess.run([sys.executable, "-m", "kilnproxy", "--config", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"kilnproxy: error: {path}: keys[0].org: org 'nobody' does not exist; "
        "add an [[orgs]] entry with id = 'nobody'"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_option_out_of_range_is_one_line(tmp_path, port):
    path = write(tmp_path, GOOD)
    proc = subprocess.run([sys.executable, "-m", "kilnproxy", "--config", str(path), f"--port={port}"],
                          capture_output=True, text=True, timeout=20)
    assert (proc.returncode, proc.stderr) == (2, f"kilnproxy: error: --port: must be between 0 and 65535, got {port}\n")


def test_missing_config_file_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kilnproxy", "--config", str(tmp_path / "none.toml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "file not found" in proc.stderr


def test_key_sha256_lets_the_file_hold_no_secret(tmp_path):
    text = GOOD.replace('key = "sk-1"', f'key_sha256 = "{sha256_hex("sk-1").upper()}"')
    assert load_config(write(tmp_path, text)).keys[0].key_sha256 == sha256_hex("sk-1")


def test_storage_url_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KILNPROXY_TEST_DB", "postgresql://kiln:pw@db:5432/kiln")
    config = load_config(write(tmp_path, '[storage]\nurl_env = "KILNPROXY_TEST_DB"\n' + GOOD))
    assert config.storage.url == "postgresql://kiln:pw@db:5432/kiln"
    assert config.storage.replica_timeout_seconds == 15 and config.spool_path == tmp_path / "kilnproxy-spool.db"


def test_check_config_never_prints_the_database_password(tmp_path):
    path = write(tmp_path, '[storage]\nurl = "postgresql://kiln:hunter2@db:5432/kiln"\n' + GOOD)
    proc = subprocess.run([sys.executable, "-m", "kilnproxy", "check-config", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "postgresql://kiln:***@db:5432/kiln" in proc.stdout and "hunter2" not in proc.stdout


def test_tracing_headers_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KILNPROXY_TEST_OTLP", "x-api-key=s3cret, x-team = ml")
    config = load_config(write(tmp_path, '[tracing]\nenabled = true\nheaders_env = "KILNPROXY_TEST_OTLP"\n' + GOOD))
    assert config.tracing.headers == (("x-api-key", "s3cret"), ("x-team", "ml"))
    assert (config.tracing.enabled, config.tracing.sample_ratio, config.tracing.service_name) == (True, 1.0, "kilnproxy")
    monkeypatch.setenv("KILNPROXY_TEST_OTLP", "s3cret-without-a-name")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, '[tracing]\nheaders_env = "KILNPROXY_TEST_OTLP"\n' + GOOD))
    assert "tracing.headers_env: the variable KILNPROXY_TEST_OTLP must hold name=value pairs" in str(info.value)
    assert "s3cret" not in str(info.value)
