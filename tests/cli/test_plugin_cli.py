"""``python -m kilnproxy plugins``: what is loaded, from where, which hooks; run as users run it."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BUILT_INS = """\
upstream_body  (built-in)
    hooks: rewrite_request
pricing  (built-in)
    hooks: transform_response
"""
HELLO = """\
hello  (entry point kilnproxy-hello 0.1.0)
    hooks: response_headers
"""


def run(tmp_path, *args):
    done = subprocess.run([sys.executable, "-m", "kilnproxy", *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    return done.returncode, done.stdout, done.stderr


def write_config(tmp_path, plugins: str) -> str:
    (tmp_path / "kiln.toml").write_text(textwrap.dedent("""
        [[models]]
        id = "m"
        upstreams = ["http://127.0.0.1:9/v1"]
        [[orgs]]
        id = "acme"
        [[keys]]
        key = "sk-1"
        org = "acme"
    """) + plugins)
    return str(tmp_path / "kiln.toml")


def test_lists_built_ins_entry_points_files_and_modules(tmp_path):
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "redact.py").write_text((REPO / "plugins" / "redact.py").read_text())
    (tmp_path / "house_rules.py").write_text(textwrap.dedent("""
        from kilnproxy import hookimpl

        @hookimpl
        def transform_event(event):
            pass

        @hookimpl
        async def check_request(call):
            pass
    """))
    config = write_config(tmp_path, '[plugins]\nmodules = ["plugins/redact.py", "house_rules"]\n')
    assert run(tmp_path, "plugins", "--config", config) == (0, BUILT_INS + HELLO + """\
redact  (plugins/redact.py)
    hooks: startup, rewrite_request, response_headers
house_rules  (house_rules)
    hooks: check_request, transform_event
""", "")


def test_entry_points_can_be_turned_off(tmp_path):
    config = write_config(tmp_path, "[plugins]\nentry_points = false\n")
    assert run(tmp_path, "plugins", "--config", config) == (0, BUILT_INS, "")


def test_without_a_config_lists_what_the_demo_loads(tmp_path):
    assert run(tmp_path, "plugins") == (0, BUILT_INS + HELLO, "")


def test_a_misspelled_hook_is_one_line_naming_the_plugin(tmp_path):
    (tmp_path / "typo.py").write_text("from kilnproxy import hookimpl\n\n@hookimpl\ndef rewrite_requests(body):\n"
                                      "    pass\n")
    config = write_config(tmp_path, '[plugins]\nmodules = ["typo.py"]\n')
    assert run(tmp_path, "plugins", "--config", config) == (2, "", (
        "kilnproxy: error: plugin 'typo': @hookimpl 'rewrite_requests' is not a kilnproxy hook;"
        " did you mean 'rewrite_request'?\n"))


def test_a_hook_argument_not_in_the_spec_is_one_line_naming_the_plugin(tmp_path):
    (tmp_path / "extra.py").write_text("from kilnproxy import hookimpl\n\n@hookimpl\n"
                                       "def rewrite_request(call, body, extra):\n    pass\n")
    config = write_config(tmp_path, '[plugins]\nmodules = ["extra.py"]\n')
    code, out, err = run(tmp_path, "plugins", "--config", config)
    assert (code, out, err.count("\n")) == (2, "", 1), err
    assert err.startswith("kilnproxy: error: plugin 'extra': ") and "extra" in err[len("kilnproxy: error: plugin 'extra': "):]


def test_async_transform_event_is_refused(tmp_path):
    (tmp_path / "slow.py").write_text("from kilnproxy import hookimpl\n\n@hookimpl\nasync def transform_event(event):"
                                      "\n    pass\n")
    config = write_config(tmp_path, '[plugins]\nmodules = ["slow.py"]\n')
    assert run(tmp_path, "plugins", "--config", config) == (2, "", (
        "kilnproxy: error: plugin 'slow': transform_event must be a plain function, not async def:"
        " it runs once per streamed event\n"))


def test_a_missing_plugin_file_is_one_line(tmp_path):
    config = write_config(tmp_path, '[plugins]\nmodules = ["plugins/nope.py"]\n')
    code, out, err = run(tmp_path, "plugins", "--config", config)
    assert (code, out) == (2, "")
    assert err == f"kilnproxy: error: plugin 'nope': [plugins] modules: file '{tmp_path}/plugins/nope.py' not found\n"
