"""A real Prometheus (Debian's) scrapes a running gateway: the series it stores have the values the
requests caused, and the shipped alert rules (docs/prometheus/) load, evaluate and match them.
The rules' own unit tests run with ``promtool test rules``."""

import re
import subprocess
from pathlib import Path

import pytest
from closed_ports import refused_port
from odd_labels import odd_org_and_discovered_models
from prometheus import PROMTOOL, Prometheus

from kilnproxy.testing import MODEL, OTHER_KEY, completion_body

RULES_DIR = Path(__file__).resolve().parents[2] / "docs" / "prometheus"
RULES = RULES_DIR / "kilnproxy-alerts.yml"
RULE_TESTS = RULES_DIR / "kilnproxy-alerts.test.yml"
GHOST = "ghost"  # a model whose only upstream refuses connections


def test_promtool_accepts_the_alert_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 8 rules found" in out.stdout


def test_the_alert_rules_pass_their_unit_tests():
    out = subprocess.run([PROMTOOL, "test", "rules", RULE_TESTS.name], capture_output=True, text=True,
                         cwd=RULES_DIR)
    assert out.returncode == 0, out.stdout + out.stderr


def rule_metric_names() -> set[str]:
    exprs = re.findall(r"^\s+expr: (.*(?:\n\s{10}.*)*)", RULES.read_text(), re.M)
    return set(re.findall(r"\bkilnproxy_[a-z_]+\b", "\n".join(exprs)))


@pytest.fixture
async def prometheus_for():
    started = []

    async def start(folder, targets):
        p = Prometheus(folder, targets, [RULES])
        started.append(p)
        return await p.start()

    yield start
    for p in started:
        await p.stop()


def with_ghost(config):
    config["server"].update(upstream_max_failures=1, upstream_down_seconds=600)  # one failure marks it down
    config["models"].append({"id": GHOST, "upstreams": [f"http://127.0.0.1:{refused_port()}/v1"],
                             "upstream_model": "ghost", "pricing": {"prompt": 1.0, "completion": 1.0}})


async def test_prometheus_scrapes_the_series_the_requests_caused(harness, pg_url, tmp_path, prometheus_for,
                                                                 eventually):
    overrides = {"storage": {"url": pg_url, "spool_path": str(tmp_path / "spool.db")}}
    async with harness(overrides=overrides, configure=with_ghost) as h:
        prom = await prometheus_for(tmp_path / "prometheus", [h.url.removeprefix("http://")])

        # Two streams held open: two requests of acme in flight
        held = [await h.post("/v1/completions", json=completion_body(stream=True, max_tokens=2000,
                                                                     mock={"delay": 0.05})) for _ in range(2)]
        for resp in held:
            assert (await resp.content.readline()).startswith(b"data: ")
        in_flight = lambda: prom.query("kilnproxy_in_flight_requests")  # noqa: E731
        await prom.until(in_flight, {(("org", "acme"),): 2.0, (("org", "globex"),): 0.0})
        for resp in held:
            resp.close()  # the client leaves: two disconnects

        for body in (completion_body(max_tokens=3), completion_body(max_tokens=5),
                     completion_body(stream=True, max_tokens=4)):
            async with h.post("/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        async with h.post("/v1/chat/completions", key=OTHER_KEY, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as resp:
            assert resp.status == 200
        async with h.post("/v1/completions", json={"model": GHOST, "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 502
        rows = await eventually(lambda: _all(h.rows(), 7))
        await prom.until(in_flight, {(("org", "acme"),): 0.0, (("org", "globex"),): 0.0})

        # the scrape target is healthy
        targets = (await prom.api("targets"))["activeTargets"]
        assert [(t["health"], t["scrapeUrl"]) for t in targets] == [("up", f"{h.url}/metrics")]

        # requests by org, model, endpoint and status: exactly the rows
        expected: dict[tuple, float] = {}
        for r in rows:
            key = (("endpoint", r["endpoint"]), ("model", r["model"]), ("org", r["org"]), ("status", str(r["status"])))
            expected[key] = expected.get(key, 0) + 1
        assert sum(expected.values()) == 7 and expected[(("endpoint", "completions"), ("model", MODEL),
                                                         ("org", "acme"), ("status", "200"))] == 5
        await prom.until(lambda: prom.query("kilnproxy_requests_total"), expected)
        await prom.until(lambda: prom.query("kilnproxy_client_disconnects_total"),
                         {(("endpoint", "completions"), ("model", MODEL), ("org", "acme")): 2.0})
        await prom.until(lambda: prom.query("kilnproxy_request_errors_total"),
                         {(("code", "upstream_unreachable"), ("endpoint", "completions"), ("model", GHOST),
                           ("org", "acme")): 1.0})

        # tokens and cost by org and model; the credits left
        for metric, column in (("kilnproxy_prompt_tokens_total", "prompt_tokens"),
                               ("kilnproxy_completion_tokens_total", "completion_tokens"),
                               ("kilnproxy_cost_usd_total", "cost")):
            sums: dict[tuple, float] = {}
            for r in rows:
                key = (("model", r["model"]), ("org", r["org"]))
                sums[key] = sums.get(key, 0) + r[column]
            assert sums[(("model", MODEL), ("org", "acme"))] > 0
            await prom.until(lambda m=metric: _rounded(prom.query(m)), _round(sums))
        spent = sum(r["cost"] for r in rows if r["org"] == "acme")
        await prom.until(lambda: _rounded(prom.query('kilnproxy_org_credits_remaining_usd{org="acme"}')),
                         _round({(("org", "acme"),): 100.0 - spent}))
        assert await prom.query("kilnproxy_org_credits_granted_usd") == {
            (("org", "acme"),): 100.0, (("org", "globex"),): 100.0}

        # upstream health: the ghost's upstream is marked down, the mock is up; the store answers
        up = await prom.until(lambda: prom.query("kilnproxy_upstream_up"), {
            (("model", MODEL), ("upstream", f"{h.mock_url}/v1")): 1.0,
            (("model", GHOST), ("upstream", h.gw.routes[GHOST].upstreams[0].base_url)): 0.0})
        assert len(up) == 2
        assert await prom.query("kilnproxy_store_up") == {(): 1.0}

        # the shipped rules evaluate without error on these series; the ghost's alerts are on their way
        await prom.until(lambda: _rule_health(prom), {"ok"})
        await prom.until(lambda: _alerts(prom), {("KilnproxyModelUnavailable", GHOST, "pending"),
                                                 ("KilnproxyUpstreamDown", GHOST, "pending")})
        scraped = set(await prom.api("label/__name__/values"))
        assert rule_metric_names() <= scraped, "a rule names a metric the gateway lacks"
        assert len(rule_metric_names()) == 6


async def _all(rows, n: int):
    got = await rows
    return got if len(got) == n else None


def _round(values: dict) -> dict:
    return {k: round(v, 9) for k, v in values.items()}


async def _rounded(query) -> dict:
    return _round(await query)


async def _rule_health(prom: Prometheus) -> set[str]:
    groups = (await prom.api("rules"))["groups"]
    return {r["health"] for g in groups for r in g["rules"]}


async def _alerts(prom: Prometheus) -> set[tuple]:
    return {(a["labels"]["alertname"], a["labels"].get("model"), a["state"])
            for a in (await prom.api("alerts"))["alerts"]}


async def test_prometheus_sees_a_gateway_that_stops(harness, tmp_path, prometheus_for):
    async with harness() as h:
        prom = await prometheus_for(tmp_path / "prometheus", [h.url.removeprefix("http://")])
        await prom.until(lambda: prom.query('up{job="kilnproxy"}'), {(): 1.0})
    await prom.until(lambda: prom.query('up{job="kilnproxy"}'), {(): 0.0})
    await prom.until(lambda: _alerts(prom), {("KilnproxyDown", None, "pending")})


async def test_prometheus_stores_odd_label_values_as_they_are(harness, tmp_path, prometheus_for):
    """Model ids from an upstream's own list and org ids hold quotes, backslashes and any letter: the scrape
    escapes them so that Prometheus stores the very values; models a client names outside the catalog are
    one series, whatever the names."""
    odd = ('q"uote\\back\\nslash', 'ünï/cödé} 1')

    async with harness(mock_options={"served_models": odd}, configure=odd_org_and_discovered_models) as h:
        for model, key, status in ((odd[0], None, 200), (odd[1], "sk-odd", 200), ("nope\n1", None, 404),
                                   ('nope"2', None, 404)):
            async with h.post("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2}, key=key) as r:
                assert r.status == status
        prom = await prometheus_for(tmp_path / "prometheus", [h.url.removeprefix("http://")])
        await prom.until(lambda: prom.query("kilnproxy_requests_total"), {
            (("endpoint", "completions"), ("model", odd[0]), ("org", "acme"), ("status", "200")): 1.0,
            (("endpoint", "completions"), ("model", odd[1]), ("org", 'or"g\\x'), ("status", "200")): 1.0,
            (("endpoint", "completions"), ("org", "acme"), ("status", "404")): 2.0})  # an empty label is none
