"""``kilnproxy orgs ...`` and ``kilnproxy keys ...`` as real processes, on an SQLite config and a PostgreSQL one.

They change the store the config names, with or without a gateway running; a running gateway sees
the change within a second by itself. Refusals are one line on stderr, exit status 2, nothing changed.
"""

import asyncio
import json
import os
import re
import sys
import time

import pytest
from closed_ports import refused_port
from processes import toml

from kilnproxy.config import load_config
from kilnproxy.store.books import open_command_store
from kilnproxy.testing import KEY, completion_body

CONFIG = {
    "models": [{"id": "m", "upstreams": ["http://127.0.0.1:1/v1"], "upstream_model": "m"}],
    "orgs": [{"id": "acme", "credits": 10.0}],
    "keys": [{"key": "sk-config-acme", "org": "acme", "id": "acme-key"}],
    "health": {"interval": 0},
}


class Result:
    def __init__(self, code, out, err):
        self.code, self.out, self.err = code, out, err

    def json(self):
        assert self.code == 0, self.err
        return json.loads(self.out)


async def kiln(cwd, *args, env=None):
    """Run ``python -m kilnproxy ARGS`` in ``cwd``; its exit status, stdout and stderr."""
    environ = {k: v for k, v in os.environ.items() if k != "KILNPROXY_CONFIG"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilnproxy", *args, cwd=cwd,
                                                env={**environ, **(env or {})}, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return Result(proc.returncode, out.decode(), err.decode())


@pytest.fixture(params=["sqlite", "postgresql"])
def config_file(request, tmp_path):
    """A config naming an SQLite file, then a fresh PostgreSQL database."""
    storage = {"path": "usage.db"}
    if request.param == "postgresql":
        storage = {"url": request.getfixturevalue("pg_url"), "spool_path": "spool.db"}
    path = tmp_path / "kiln.toml"
    path.write_text(toml({"storage": storage, **CONFIG}))
    return path


async def events(config_file):
    async with open_command_store(load_config(config_file)) as store:
        return await store.list_events()


async def test_orgs_commands(config_file):
    cwd, c = config_file.parent, ("--config", str(config_file))
    made = (await kiln(cwd, "orgs", "create", "beta", "--max-in-flight", "4", "--json", *c)).json()
    assert made == {"id": "beta", "granted": 0.0, "spent": 0.0, "held": 0.0, "remaining": 0.0, "max_in_flight": 4,
                    "disabled": False, "source": "api", "requests_per_minute": None, "tokens_per_minute": None,
                    "priority": "interactive", "weight": 1.0}
    first = (await kiln(cwd, "orgs", "grant", "beta", "25", "--reference", "pay-1", "--json", *c)).json()
    assert (first["org"], first["amount"], first["reference"]) == ("beta", 25.0, "pay-1")
    again = await kiln(cwd, "orgs", "grant", "beta", "25", "--reference", "pay-1", *c)
    assert again.code == 0 and "already used" in again.out and first["id"] in again.out
    assert (await kiln(cwd, "orgs", "grant", "acme", "-2.5", "--reference", "fix", "--json", *c)).json()["amount"] == -2.5
    changed = (await kiln(cwd, "orgs", "update", "beta", "--disabled", "true", "--max-in-flight", "none",
                          "--priority", "batch", "--weight", "2.5", "--json", *c)).json()
    assert changed == {**made, "granted": 25.0, "remaining": 25.0, "disabled": True, "max_in_flight": None,
                       "priority": "batch", "weight": 2.5}
    assert (await kiln(cwd, "orgs", "show", "beta", "--json", *c)).json() == changed
    listing = (await kiln(cwd, "orgs", "list", "--json", *c)).json()
    assert [(o["id"], o["source"], o["granted"]) for o in listing["data"]] == [("acme", "config", 7.5),
                                                                             ("beta", "api", 25.0)]
    table = await kiln(cwd, "orgs", "list", *c)
    assert table.code == 0
    assert table.out.splitlines()[0].split() == ["org", "source", "granted", "spent", "held", "remaining", "in",
                                                 "flight", "disabled", "priority", "weight"]
    assert table.out.splitlines()[2].split() == ["beta", "api", "25.0", "0.0", "0.0", "25.0", "-", "yes", "batch",
                                                 "2.5"]
    assert [(e["kind"], e["actor"]) for e in await events(config_file)] == [
        ("org.updated", "cli"), ("grant.created", "cli"), ("grant.created", "cli"), ("org.created", "cli")]


async def test_keys_commands_print_the_secret_once(config_file):
    cwd, c = config_file.parent, ("--config", str(config_file))
    made = await kiln(cwd, "keys", "create", "--org", "acme", "--name", "ci", "--limit", "5", "--limit-reset",
                      "weekly", "--expires-at", "2099-01-01", "--models", "m", *c)
    assert made.code == 0, made.err
    secret = re.search(r"^secret: (sk-\S+)$", made.out, re.M).group(1)
    assert made.out.count(secret) == 1
    key_id = re.search(r"^id\s+(key_\w+)$", made.out, re.M).group(1)
    shown = (await kiln(cwd, "keys", "show", key_id, "--json", *c)).json()
    assert shown == {"id": key_id, "name": "ci", "org": "acme", "role": "member", "prefix": secret[:8],
                     "models": ["m"],
                     "disabled": False, "revoked": False, "limit": 5.0, "limit_reset": "weekly", "usage": 0.0,
                     "limit_remaining": 5.0, "expires_at": "2099-01-01T00:00:00.000+00:00",
                     "created_at": shown["created_at"], "source": "api", "requests_per_minute": None,
                     "tokens_per_minute": None, "priority": None, "weight": None}
    by_json = (await kiln(cwd, "keys", "create", "--org", "acme", "--name", "bot", "--role", "admin", "--json",
                          *c)).json()
    assert by_json["key"].startswith("sk-") and (by_json["data"]["name"], by_json["data"]["role"]) == ("bot", "admin")
    # the operator's commands may demote the org's last admin key (an org admin could not)
    demoted = await kiln(cwd, "keys", "update", by_json["data"]["id"], "--role", "member", "--json", *c)
    assert demoted.code == 0 and demoted.json()["role"] == "member"
    updated = (await kiln(cwd, "keys", "update", key_id, "--limit", "none", "--models", "all", "--disabled", "true",
                          "--role", "admin", "--json", *c)).json()
    assert updated == {**shown, "limit": None, "limit_remaining": None, "models": None, "disabled": True,
                       "role": "admin"}
    revoked = (await kiln(cwd, "keys", "revoke", key_id, "--json", *c)).json()
    assert revoked == {**updated, "revoked": True}
    listing = (await kiln(cwd, "keys", "list", "--org", "acme", "--json", *c)).json()
    assert [k["id"] for k in listing["data"]] == ["acme-key", key_id, by_json["data"]["id"]]
    table = await kiln(cwd, "keys", "list", *c)
    assert re.search(rf"^{key_id}\s+ci\s+acme\s+admin\s+{re.escape(secret[:8])}\s+api\s+revoked\s", table.out, re.M)
    everything = await asyncio.gather(*(kiln(cwd, *args, *c) for args in (("keys", "list"), ("keys", "show", key_id),
                                                                        ("orgs", "list"))))
    assert not any(secret in r.out + r.err for r in everything)
    assert secret not in repr(await events(config_file))
    for path in config_file.parent.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


REFUSALS = [  # (arguments, what the one line says)
    (("orgs", "create", "acme"), "already exists"),
    (("orgs", "create", "has space"), "ID: `id` must be"),
    (("orgs", "update", "acme", "--disabled", "true"), "is in the gateway's config"),
    (("orgs", "update", "nope", "--disabled", "true"), "No org `nope`"),
    (("orgs", "update", "nope", "--max-in-flight", "0"), "--max-in-flight: `max_in_flight` must be"),
    (("orgs", "create", "big", "--max-in-flight", str(2**64 - 1)), "--max-in-flight: `max_in_flight` must be"),
    (("orgs", "create", "big", "--max-in-flight", "99999999999999999999"), "--max-in-flight: `max_in_flight` must be"),
    (("orgs", "update", "beta", "--tokens-per-minute", str(2**63)), "--tokens-per-minute: `tokens_per_minute` must be"),
    (("orgs", "update", "acme", "--disabled", "maybe"), "expected true or false"),
    (("orgs", "update", "beta", "--priority", "urgent"), "--priority: `priority` must be one of interactive, batch"),
    (("orgs", "update", "beta", "--weight", "0"), "--weight: `weight` must be a number above 0"),
    (("orgs", "update", "beta", "--weight", "heavy"), "expected a number"),
    (("keys", "create", "--org", "acme", "--name", "n", "--priority", "low"), "--priority: `priority` must be one of"),
    (("keys", "create", "--org", "acme", "--name", "n", "--weight", "-1"), "--weight: `weight` must be a number above"),
    (("orgs", "grant", "nope", "5", "--reference", "r"), "No org `nope`"),
    (("orgs", "grant", "acme", "five", "--reference", "r"), "expected an amount"),
    (("orgs", "grant", "acme", "5"), "--reference"),
    (("orgs", "grant", "acme", "1e308", "--reference", "r"), "AMOUNT: `amount` must be at most 1,000,000,000,000 USD"),
    (("keys", "create", "--org", "nope", "--name", "n"), "No org `nope`"),
    (("keys", "create", "--org", "acme", "--name", "n", "--role", "owner"), "--role: `role` must be admin or member."),
    (("keys", "create", "--org", "acme", "--name", "n", "--limit", "-1"), "--limit: `limit` must not be negative"),
    (("keys", "create", "--org", "acme", "--name", "n", "--limit-reset", "hourly"), "--limit-reset:"),
    (("keys", "create", "--org", "acme", "--name", "n", "--expires-at", "soon"), "--expires-at:"),
    (("keys", "create", "--org", "acme", "--name", "n", "--expires-at", "9999-12-31T23:59:59-23:59"),
     "--expires-at: `expires_at` is out of range"),
    (("keys", "create", "--org", "acme", "--name", "n", "--models", ""), "--models: expected model ids"),
    (("keys", "update", "key_nope", "--models", " "), "--models: expected model ids"),
    (("keys", "update", "acme-key", "--name", "x"), "is in the gateway's config"),
    (("keys", "revoke", "acme-key"), "is in the gateway's config"),
    (("keys", "revoke", "key_nope"), "No key `key_nope`"),
]


async def test_refusals_are_one_line_and_change_nothing(config_file):
    cwd, c = config_file.parent, ("--config", str(config_file))
    assert (await kiln(cwd, "orgs", "create", "beta", *c)).code == 0
    before = await events(config_file)
    results = await asyncio.gather(*(kiln(cwd, *args, *c) for args, _ in REFUSALS))  # each refused alone too
    for (args, says), result in zip(REFUSALS, results):
        assert result.code == 2, (args, result.out, result.err)
        assert result.out == "" and len(result.err.splitlines()) == 1, (args, result.err)
        assert result.err.startswith("kilnproxy: error: ") and says in result.err, (args, result.err)
    assert await events(config_file) == before
    no_config = await kiln(cwd, "orgs", "list")
    assert no_config.code == 2 and "--config" in no_config.err
    by_env = await kiln(cwd, "orgs", "list", "--json", env={"KILNPROXY_CONFIG": str(config_file)})
    assert [o["id"] for o in by_env.json()["data"]] == ["acme", "beta"]


async def test_a_database_out_of_reach_is_one_line_without_the_password(tmp_path):
    url = f"postgresql://kiln:hunter2@127.0.0.1:{refused_port()}/nowhere"
    (tmp_path / "kiln.toml").write_text(toml({"storage": {"url": url}, **CONFIG}))
    result = await kiln(tmp_path, "orgs", "list", "--config", "kiln.toml")
    assert result.code == 2 and len(result.err.splitlines()) == 1, result.err
    assert "cannot connect to PostgreSQL" in result.err and "hunter2" not in result.err


async def test_a_running_gateway_takes_the_commands_changes_within_a_second(harness, store, tmp_path):
    async with harness(overrides=store) as h:
        config_file = tmp_path / "kiln.toml"
        config_file.write_text(toml(h.config))
        c = ("--config", str(config_file))

        async def within_a_second(check):
            deadline = time.monotonic() + 1.0
            while not await check():
                assert time.monotonic() < deadline, "not in force within 1 s"
                await asyncio.sleep(0.02)

        async def status(key):
            async with h.post("/v1/completions", completion_body(), key=key) as resp:
                return resp.status

        made = (await kiln(tmp_path, "keys", "create", "--org", "acme", "--name", "cli", "--json", *c)).json()
        await within_a_second(lambda: _is(status(made["key"]), 200))
        (await kiln(tmp_path, "orgs", "grant", "acme", "50", "--reference", "r", "--json", *c)).json()

        async def granted():
            async with h.session.get(f"{h.url}/v1/credits", headers=h.headers(KEY)) as resp:
                return (await resp.json())["granted"] == 150.0

        await within_a_second(granted)
        (await kiln(tmp_path, "keys", "revoke", made["data"]["id"], "--json", *c)).json()
        await within_a_second(lambda: _is(status(made["key"]), 401))


async def _is(value, expected):
    return await value == expected
