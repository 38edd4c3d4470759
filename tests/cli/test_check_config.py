"""`python -m kilnproxy check-config FILE`: what a config would serve, or one line saying what is wrong."""

import subprocess
import sys
from pathlib import Path

import pytest
from processes import gateway_config, toml

from kilnproxy.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kilnproxy", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_a_valid_config_prints_what_it_would_serve(tmp_path):
    config = gateway_config(["http://10.0.0.7:8000/v1", "http://10.0.0.8:8000/v1"],
                            server={"port": 9001, "shutdown_grace_seconds": 12},
                            health={"interval": 2.5, "path": "/v1/models"},
                            admin={"token": "adm", "allow_loopback": False},
                            log={"access": True, "bodies": True},
                            maintenance={"enabled": True, "retry_after": "Tue, 01 Dec 2026 06:00:00 GMT"})
    config["keys"][1]["role"] = "admin"
    path = tmp_path / "gw.toml"
    path.write_text(toml(config))
    out = check(path)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines() == [
        f"{path}: OK",
        "  listen   127.0.0.1:9001",
        f"  storage  {tmp_path / 'usage.db'}",
        "  model    test-model -> org/Test-Model-7B via http://10.0.0.7:8000/v1, http://10.0.0.8:8000/v1,"
        " routing least_busy",
        "  org      acme: 100.0 USD, 200 in flight, interactive, weight 1, 1 key(s)",
        "  org      globex: 100.0 USD, 8 in flight, interactive, weight 1, 1 key(s) (1 admin)",
        "  ops      metrics on, access log on with bodies, health checks every 2.5 s on /v1/models, admin token,"
        " drain 0 s, shutdown grace 12 s",
        "  maintenance on (Retry-After: Tue, 01 Dec 2026 06:00:00 GMT)",
    ]


def test_capped_upstreams_show_their_slots_and_batch_reserve_and_orgs_their_share(tmp_path):
    config = gateway_config(["http://10.0.0.7:8000/v1", "http://10.0.0.8:8000/v1"])
    config["models"][0]["upstreams"] = [{"url": "http://10.0.0.7:8000/v1", "max_in_flight": 4},
                                        {"url": "http://10.0.0.8:8000/v1", "max_in_flight": 6, "batch_reserve": 2},
                                        "http://10.0.0.9:8000/v1"]
    config["orgs"][1].update(priority="batch", weight=2.5)
    path = tmp_path / "gw.toml"
    path.write_text(toml(config))
    out = check(path)
    assert (out.returncode, out.stderr) == (0, "")
    lines = out.stdout.splitlines()
    assert ("  model    test-model -> org/Test-Model-7B via http://10.0.0.7:8000/v1 (max_in_flight 4, batch_reserve 1),"
            " http://10.0.0.8:8000/v1 (max_in_flight 6, batch_reserve 2), http://10.0.0.9:8000/v1,"
            " routing least_busy") in lines
    assert "  org      globex: 100.0 USD, 8 in flight, batch, weight 2.5, 1 key(s)" in lines


def test_the_example_config_is_valid():
    out = check(ROOT / "config.example.toml")
    assert out.returncode == 0, out.stderr
    assert "health checks every 10 s on /health, admin loopback, drain 5 s, shutdown grace 30 s" in out.stdout


@pytest.mark.parametrize("change, message", [
    ({"health": {"intervall": 3}}, "health.intervall: unknown key (check its spelling against config.example.toml)"),
    ({"health": {"path": "health"}}, "health.path: must start with '/'"),
    ({"health": {"interval": -1}}, "health.interval: must be 0 (no active checks) or more, got -1"),
    ({"server": {"shutdown_grace_seconds": 0}}, "server.shutdown_grace_seconds: must be greater than 0, got 0"),
    ({"admin": {"token": "a", "token_sha256": "0" * 64}}, "admin.token: give token or token_sha256, not both"),
    ({"log": {"access": "yes"}}, "log.access: must be true or false, got str 'yes'"),
    ({"keys": [{"key": "k", "org": "ghost"}]}, "keys[0].org: org 'ghost' does not exist"),
])
def test_a_bad_config_exits_non_zero_with_one_line(tmp_path, capsys, change, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml(gateway_config(["http://10.0.0.7:8000/v1"], **change)))
    assert main(["check-config", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"kilnproxy: error: {path}: {message}")


def test_a_storage_path_that_cannot_be_a_database_is_one_line_as_at_start_up(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    (tmp_path / "ledger").mkdir()
    path.write_text(toml(gateway_config(["http://10.0.0.7:8000/v1"], storage={"path": "ledger"})))
    assert main(["check-config", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"kilnproxy: error: cannot open the usage database '{tmp_path / 'ledger'}' for "
                              "writing: unable to open database file (check [storage] path")


def test_check_config_makes_no_database_file(tmp_path):
    path = tmp_path / "gw.toml"
    path.write_text(toml(gateway_config(["http://10.0.0.7:8000/v1"], storage={"path": "new/usage.db"})))
    assert check(path).returncode == 0
    assert not (tmp_path / "new").exists()


def test_a_missing_file_or_bad_toml_is_one_line(tmp_path):
    out = check(tmp_path / "nope.toml")
    assert (out.returncode, out.stderr) == (2, f"kilnproxy: error: {tmp_path / 'nope.toml'}: file not found\n")
    (tmp_path / "broken.toml").write_text("[server\n")
    out = check(tmp_path / "broken.toml")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not valid TOML" in out.stderr


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """``check-config FILE | head -1``: the pipe closes before the output is written."""
    path = tmp_path / "config.toml"
    path.write_text(toml(gateway_config(["http://10.0.0.7:8000/v1"])))
    proc = subprocess.Popen([sys.executable, "-m", "kilnproxy", "check-config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
