"""The org admins' portal (/portal/, docs/portal.md) in Debian's chromium, driven by Playwright (as the
inspector's browser tests), on both stores: an admin signs in with its key, reads its org's balance and spend (the chart's
figures are the usage API's), makes a key and uses it with the openai SDK, limits it, revokes it and sees it
refused; the key's secret is then in no log, row or file. A member key is told it is not an admin key. A page
of another origin reads nothing from the org API, with or without the key, and cannot frame the portal."""

import uuid
from datetime import datetime, timedelta, timezone

import openai
from browser import ARTIFACTS, chromium_page, tooltip_lines
from money_text import written

from kilnproxy.testing import KEY, OTHER_KEY
from kilnproxy.usage import COLUMNS

MEMBER = "sk-test-acme-member"
PROMPT = "The portal never shows this prompt"
SECOND_MODEL = "test-model-large"


def admins(config):
    """acme's config key is an admin key; acme also has a member key; two models, one dearer."""
    config["keys"][0]["role"] = "admin"
    config["keys"].append({"key": MEMBER, "org": "acme", "id": "acme-member"})
    config["models"].append({**config["models"][0], "id": SECOND_MODEL,
                             "pricing": {"prompt": 1.0, "completion": 3.0}})


async def org_api(h, path, key=KEY, **params):
    async with h.session.get(f"{h.url}{path}", params=params, headers=h.headers(key)) as resp:
        return resp.status, await resp.json()


async def earlier_row(h, days_ago, key_id, model, cost):
    """A row of a request ``days_ago`` days before today (UTC), charged and written as the gateway's own."""
    at = datetime.now(timezone.utc).replace(hour=12, minute=0, second=0, microsecond=0) - timedelta(days=days_ago)
    row = dict.fromkeys(COLUMNS, 0) | {
        "id": f"gen-{uuid.uuid4().hex[:24]}", "created_at": at.isoformat(timespec="milliseconds"),
        "org": "globex" if key_id == "globex-key" else "acme", "key_id": key_id, "model": model,
        "requested_model": model, "endpoint": "completions", "status": 200, "error_code": None,
        "prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12, "cost": cost, "finish_reason": "stop",
        "upstream": None, "batch_id": None}
    h.gw.credits.charge(row["org"], cost)
    await h.gw.ledger.submit(row)


async def sign_in(page, h, key):
    await page.goto(f"{h.url}/portal/")
    await page.fill("#key-input", key)
    await page.click("#sign-in-form button[type=submit]")


async def cells(page, selector):
    return await page.locator(selector).locator("td").all_inner_texts()


async def wait_text(page, selector, text):
    await page.wait_for_function("([s, t]) => document.querySelector(s) && document.querySelector(s).textContent === t",
                                 arg=[selector, text])


async def test_an_admin_signs_in_makes_a_key_uses_it_and_revokes_it(harness, store, tmp_path, capsys, caplog):
    async with harness(configure=admins, overrides={**store, "log": {"access": True, "bodies": True}}) as h, \
            chromium_page() as page:
        page.on("dialog", lambda dialog: dialog.accept())  # the "revoke?" confirmation
        asked = []  # every request the page makes
        page.on("request", lambda r: asked.append((r.method, r.url.removeprefix(h.url).split("?")[0], r.headers)))
        sdk = h.openai()
        await sdk.completions.create(model=h.model, prompt=PROMPT, max_tokens=4)
        await sdk.completions.create(model=SECOND_MODEL, prompt=PROMPT, max_tokens=6)
        await h.openai(key=MEMBER).completions.create(model=h.model, prompt="a member's", max_tokens=2)
        await h.openai(key=OTHER_KEY).completions.create(model=h.model, prompt="globex's own", max_tokens=2)
        for days_ago, key_id, model, cost in [(3, "acme-key", SECOND_MODEL, 0.0421), (3, "acme-member", h.model, 2e-7),
                                              (11, "acme-member", h.model, 1.25), (29, "acme-key", h.model, 0.5),
                                              (30, "acme-key", h.model, 7.0), (3, "globex-key", h.model, 9.0)]:
            await earlier_row(h, days_ago, key_id, model, cost)  # days 30 ago and globex's: not on the page
        await h.rows()  # every row committed

        await sign_in(page, h, KEY)
        await page.wait_for_selector("#dashboard:not([hidden])")
        await page.wait_for_selector('#keys-table tr[data-key="acme-member"]')
        assert await page.input_value("#key-input") == ""  # the key left the form
        assert await page.inner_text("#org-id") == "acme"
        _, org = await org_api(h, "/v1/org")
        for field in ("granted", "spent", "held", "remaining"):
            assert await page.inner_text(f"#{field}") == written(org[field]), field
        for key in (await org_api(h, "/v1/org/keys"))[1]["data"]:  # the config's keys: no buttons
            assert await cells(page, f'#keys-table tr[data-key="{key["id"]}"]') == [
                key["name"], key["id"], f"{key['prefix']}…" if key["prefix"] else "–", key["role"],
                f"{written(key['usage'])} / no limit", "never", "–", "active", "", "config"]

        # the spend: the chart's figures and the tables are the usage API's
        await page.wait_for_function("() => window.Chart && Chart.getChart('chart-spend')")
        await assert_spend_is_the_apis(page, h)

        # create a key: its secret shown once, with a copy button
        await page.fill("#key-form input[name=name]", "ci")
        await page.fill("#key-form input[name=limit]", "2")
        await page.select_option("#key-form select[name=limit_reset]", "monthly")
        await page.click("#key-form button[type=submit]")
        await page.wait_for_selector("#secret-box:not([hidden])")
        secret = await page.inner_text("#secret-value")
        _, listing = await org_api(h, "/v1/org/keys")
        [made] = [k for k in listing["data"] if k["name"] == "ci"]
        assert secret.startswith("sk-") and secret[:8] == made["prefix"]
        assert (made["role"], made["limit"], made["limit_reset"], made["org"]) == ("member", 2.0, "monthly", "acme")
        assert await page.inner_text("#secret-key-id") == made["id"]
        row = f'#keys-table tr[data-key="{made["id"]}"]'
        await page.wait_for_selector(row)
        assert (await cells(page, row))[:8] == ["ci", made["id"], f"{secret[:8]}…", "member", "$0.00 / $2.00",
                                                "monthly", "–", "active"]
        await page.context.grant_permissions(["clipboard-read", "clipboard-write"])
        await page.click("#secret-copy")
        await wait_text(page, "#secret-copy", "copied")
        assert await page.evaluate("navigator.clipboard.readText()") == secret

        # the key works with the openai SDK at once; refresh shows its usage against its limit
        used = await h.openai(key=secret).completions.with_raw_response.create(model=h.model, prompt="hi",
                                                                               max_tokens=3)
        cost = (await h.row(used.headers["X-Neocloud-Generation-Id"]))["cost"]
        await page.click("#refresh")
        await wait_text(page, f"{row} .usage", f"{written(cost)} / $2.00")
        await assert_spend_is_the_apis(page, h)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "portal.png"), full_page=True)  # docs/portal.png
        await page.select_option("#range select[name=days]", "7")
        await assert_spend_is_the_apis(page, h, days=7)

        # set a limit; then none
        await page.fill(f"{row} input.limit", "5.5")
        await page.click(f"{row} button.set-limit")
        await wait_text(page, f"{row} .usage", f"{written(cost)} / $5.50")
        assert [k["limit"] for k in (await org_api(h, "/v1/org/keys"))[1]["data"] if k["id"] == made["id"]] == [5.5]
        await page.fill(f"{row} input.limit", "")
        await page.click(f"{row} button.set-limit")
        await wait_text(page, f"{row} .usage", f"{written(cost)} / no limit")
        # a refusal is shown, and changes nothing
        await page.fill(f"{row} input.limit", "-1")
        await page.click(f"{row} button.set-limit")
        await page.wait_for_function("() => document.querySelector('#error').textContent.includes('limit')")
        assert "400 invalid_request" in await page.inner_text("#error")
        assert [k["limit"] for k in (await org_api(h, "/v1/org/keys"))[1]["data"] if k["id"] == made["id"]] == [None]

        # shown once: gone when dismissed
        await page.click("#secret-done")
        assert await page.is_hidden("#secret-box")
        assert secret not in await page.content()

        # revoke: refused from then on
        await page.click(f"{row} button.revoke")
        await wait_text(page, f"{row} .state", "revoked")
        assert await page.locator(f"{row} button").count() == 0
        try:
            await h.openai(key=secret).completions.create(model=h.model, prompt="hi", max_tokens=3)
            raise AssertionError("a revoked key was served")
        except openai.AuthenticationError as refused:
            assert (refused.status_code, refused.body["code"]) == (401, "invalid_api_key")

        # no prompt, no completion, nothing of another org; the key in no cookie, storage or address
        content = await page.content()
        for foreign in (PROMPT, "globex", " Paris"):
            assert foreign not in content, foreign
        assert await page.evaluate("[document.cookie, localStorage.length, sessionStorage.length]") == ["", 0, 0]
        assert KEY not in page.url and KEY not in content

        # the page talks to its own files and the org API only, with the key as a bearer token and no cookie
        assert {path for _, path, _ in asked} >= {"/portal/", "/v1/org", "/v1/org/keys", "/v1/org/usage",
                                                  f"/v1/org/keys/{made['id']}"}
        assert [path for _, path, _ in asked if not path.startswith(("/portal/", "/v1/org"))] == []
        assert all(headers.get("authorization") == f"Bearer {KEY}" for _, path, headers in asked
                   if path.startswith("/v1/org"))
        assert [headers for _, _, headers in asked if "cookie" in headers] == []

        await page.click("#sign-out")
        assert await page.is_visible("#sign-in") and await page.is_hidden("#dashboard")
        assert "acme-key" not in await page.content()

        answers = [await org_api(h, p) for p in ("/v1/org/keys", f"/v1/org/keys/{made['id']}", "/v1/org/events")]
        assert secret not in repr(answers)
        assert secret not in repr(await h.rows()) and secret[8:] not in repr(await h.rows())
        events = (await org_api(h, "/v1/org/events"))[1]["data"]
        assert [(e["kind"], e["actor"]) for e in events][:4] == [("key.revoked", "key:acme-key")] + [
            ("key.updated", "key:acme-key")] * 2 + [("key.created", "key:acme-key")]
    out = capsys.readouterr()
    assert secret not in out.out + out.err + caplog.text
    assert secret[8:] not in out.out + out.err + caplog.text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
            assert secret[8:].encode() not in path.read_bytes(), path


async def assert_spend_is_the_apis(page, h, days=30):
    """The chart: a bar a day over the last ``days`` days (UTC), each the usage API's cost of that day (0 for a
    day without rows); the tables by model and by key: the API's rows, in its order, money written one way."""
    today = datetime.now(timezone.utc).date()
    first = (today - timedelta(days=days - 1)).isoformat()
    _, by_day = await org_api(h, "/v1/org/usage", **{"from": first, "group_by": "day"})
    _, by_model = await org_api(h, "/v1/org/usage", **{"from": first, "group_by": "model"})
    _, by_key = await org_api(h, "/v1/org/usage", **{"from": first, "group_by": "key"})
    _, totals = await org_api(h, "/v1/org/usage", **{"from": first})
    [total] = totals["data"]
    expected_days = [(today - timedelta(days=days - 1 - i)).isoformat() for i in range(days)]
    costs = {r["day"]: r["cost"] for r in by_day["data"]}
    await page.wait_for_function(
        "([n, days]) => { const c = Chart.getChart('chart-spend'); return c && c.data.labels.length === days"
        " && c.data.datasets[0].data.filter(v => v).length === n; }", arg=[len(costs), days])
    chart = await page.evaluate("(() => { const c = Chart.getChart('chart-spend');"
                                " return {labels: c.data.labels, data: c.data.datasets[0].data}; })()")
    assert chart == {"labels": expected_days, "data": [costs.get(d, 0) for d in expected_days]}
    for day, cost in costs.items():  # what the admin reads over each bar, and on the axis
        assert await tooltip_lines(page, "chart-spend", expected_days.index(day)) == [written(cost)]
    ticks = await page.evaluate("Chart.getChart('chart-spend').scales.y.ticks.map(t => t.label)")
    assert ticks and not [t for t in ticks if "e" in t or not t.startswith("$")]
    ago = {(today - timedelta(days=n)).isoformat() for n in (29, 11, 3, 0) if n < days}  # not 30 days ago
    assert set(costs) == ago
    await page.wait_for_function("(n) => document.querySelectorAll('#by-key tbody tr').length === n",
                                 arg=len(by_key["data"]))
    models = [await cells(page, f"#by-model tbody tr:nth-child({i + 1})") for i in range(len(by_model["data"]))]
    assert models == [[r["model"], f"{r['requests']:,}", f"{r['prompt_tokens']:,} / {r['completion_tokens']:,}",
                       written(r["cost"])] for r in by_model["data"]]
    keys = [await cells(page, f"#by-key tbody tr:nth-child({i + 1})") for i in range(len(by_key["data"]))]
    assert [k[1:] for k in keys] == [[r["key_id"], f"{r['requests']:,}",
                                      f"{r['prompt_tokens']:,} / {r['completion_tokens']:,}", written(r["cost"])]
                                     for r in by_key["data"]]
    assert {r["key_id"] for r in by_key["data"]} >= {"acme-key", "acme-member"}
    assert "globex-key" not in {r["key_id"] for r in by_key["data"]}
    assert await page.inner_text("#spend-total") == (
        f"{written(total['cost'])} in {total['requests']:,} requests since {first}")


async def test_a_key_that_is_not_an_admin_key_signs_nobody_in(harness):
    async with harness(configure=admins) as h, chromium_page() as page:
        for key, told in [(MEMBER, "This key is not an admin key: it may call models, not manage its org "
                                   "(403 forbidden)."),
                          (OTHER_KEY, "This key is not an admin key: it may call models, not manage its org "
                                      "(403 forbidden)."),
                          ("sk-nobody-knows-this", "The gateway does not know this key, or it was revoked or has "
                                                   "expired (401 invalid_api_key).")]:
            await sign_in(page, h, key)
            await wait_text(page, "#sign-in-error", told)
            assert await page.is_hidden("#dashboard") and await page.is_visible("#sign-in")
            assert await page.input_value("#key-input") == ""
            assert await page.locator("#keys-table tbody tr").count() == 0


async def test_an_admin_key_revoked_elsewhere_is_signed_out_at_its_next_read(harness):
    async with harness(configure=admins) as h, chromium_page() as page:
        async with h.session.post(f"{h.url}/v1/org/keys", json={"name": "second admin", "role": "admin"},
                                  headers=h.headers()) as resp:
            assert resp.status == 201
            made = await resp.json()
        await sign_in(page, h, made["key"])
        await page.wait_for_selector('#keys-table tr[data-key="acme-key"]')
        async with h.session.delete(f"{h.url}/v1/org/keys/{made['data']['id']}", headers=h.headers()) as resp:
            assert resp.status == 200  # by the other admin
        await page.click("#refresh")
        await wait_text(page, "#sign-in-error", "Signed out: The gateway does not know this key, or it was revoked "
                                                "or has expired (401 invalid_api_key).")
        assert await page.is_hidden("#dashboard")
        assert await page.locator("#keys-table tbody tr").count() == 0
        assert "acme" not in await page.inner_text("body")


async def test_names_others_chose_are_shown_as_text(harness):
    """A key's name (an admin chose it) and a model's (any client may ask for any): text, never markup; the
    page's Content-Security-Policy would refuse a script anyway (chromium_page fails on a page error)."""
    markup = '<img src=x onerror="window.ran=1">'
    async with harness(configure=admins) as h, chromium_page() as page:
        async with h.session.post(f"{h.url}/v1/org/keys", json={"name": markup}, headers=h.headers()) as resp:
            made = (await resp.json())["data"]
        async with h.post("/v1/completions", {"model": markup, "prompt": "x"}) as resp:
            assert resp.status == 404
        await h.rows()
        await sign_in(page, h, KEY)
        await page.wait_for_selector(f'#keys-table tr[data-key="{made["id"]}"]')
        await page.wait_for_selector("#by-model tbody tr")
        assert (await cells(page, f'#keys-table tr[data-key="{made["id"]}"]'))[0] == markup
        assert markup in [(await cells(page, f"#by-model tbody tr:nth-child({i + 1})"))[0]
                          for i in range(await page.locator("#by-model tbody tr").count())]
        assert await page.locator("main img").count() == 0
        assert await page.evaluate("window.ran") is None
