"""The inspector's "Orgs & keys" page in Debian's chromium (Playwright, as tests/inspector/test_inspector_browser.py):
create a key and see its secret once, use it, grant credits, revoke it."""


from browser import ARTIFACTS, chromium_page

from kilnproxy.testing import completion_body


async def complete(h, key):
    async with h.post("/v1/completions", completion_body(), key=key) as resp:
        await resp.read()
        return resp.status


async def cells(page, selector):
    return await page.locator(selector).locator("td").all_inner_texts()


async def test_keys_and_credits_are_managed_from_the_page(harness):
    async with harness() as h, chromium_page() as page:
        page.on("dialog", lambda dialog: dialog.accept())  # the "revoke?" confirmation
        await page.goto(f"{h.url}/ui/#/orgs")
        await page.wait_for_selector('#orgs-table tr[data-org="acme"]')
        assert (await cells(page, '#orgs-table tr[data-org="acme"]'))[:9] == [
            "acme", "config", "$100.00", "$0.00", "$0.00", "$100.00", "default", "interactive", "1"]

        await page.click('#orgs-table tr[data-org="acme"]')
        await page.wait_for_selector('#keys-table tr[data-key="acme-key"]')
        assert page.url.endswith("/ui/#/orgs/acme")
        assert (await cells(page, '#keys-table tr[data-key="acme-key"]'))[-1] == "config"  # no revoke button

        # a refusal names the field and makes nothing
        await page.fill("#key-form input[name=name]", "browser")
        await page.fill("#key-form input[name=expires_at]", "soon")
        await page.click("#key-form button[type=submit]")
        await page.wait_for_function("() => document.querySelector('#org-error').textContent.includes('expires_at')")
        assert await h.gw.tenancy.list_keys() == []

        await page.fill("#key-form input[name=expires_at]", "")
        await page.fill("#key-form input[name=limit]", "2")
        await page.select_option("#key-form select[name=limit_reset]", "monthly")
        await page.select_option("#key-form select[name=priority]", "batch")
        await page.select_option("#key-form select[name=role]", "admin")
        await page.click("#key-form button[type=submit]")
        await page.wait_for_selector("#secret-box:not([hidden])")
        secret = await page.inner_text("#secret-value")
        [key] = await h.gw.tenancy.list_keys()
        assert secret.startswith("sk-") and secret[:8] == key["prefix"]
        assert await page.inner_text("#secret-key-id") == key["id"]
        row = f'#keys-table tr[data-key="{key["id"]}"]'
        await page.wait_for_selector(row)
        assert (await cells(page, row))[:10] == ["browser", key["id"], f"{secret[:8]}…", "admin", "$0.00 / $2.00",
                                                 "monthly", "–", "–", "batch / org's", "active"]
        assert (key["role"], key["priority"]) == ("admin", "batch")
        assert (await cells(page, '#keys-table tr[data-key="acme-key"]'))[3] == "member"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "inspector-orgs.png"), full_page=True)

        assert await complete(h, secret) == 200  # the new key works at once
        # the request's row comes over the live feed, and the open page refreshes the key's usage
        await page.wait_for_function(f"() => document.querySelector('{row} .last-used').textContent !== '–'")
        assert (await cells(page, row))[4] == "$0.0000017 / $2.00"  # three significant digits

        # shown once: gone when dismissed, and never served again
        await page.click("#secret-done")
        assert await page.is_hidden("#secret-box")
        assert secret not in await page.content()
        await page.reload()
        await page.wait_for_selector(row)
        assert secret not in await page.content()

        await page.fill("#grant-form input[name=amount]", "25")
        await page.fill("#grant-form input[name=reference]", "invoice-1042")
        await page.click("#grant-form button[type=submit]")
        await page.wait_for_function("() => document.querySelector('#grant-note').textContent === 'granted $25.00'")
        await page.wait_for_function(
            "() => document.querySelector('#orgs-table tr[data-org=\"acme\"] .granted').textContent === '$125.00'")
        assert (await cells(page, "#grants-table tbody tr"))[1:3] == ["$25.00", "invoice-1042"]
        await page.fill("#grant-form input[name=amount]", "99")  # a retried payment: credits once
        await page.fill("#grant-form input[name=reference]", "invoice-1042")
        await page.click("#grant-form button[type=submit]")
        await page.wait_for_function("() => document.querySelector('#grant-note').textContent.includes('used already')")
        assert await page.locator("#grants-table tbody tr").count() == 1
        assert h.gw.credits.granted["acme"] == 125.0

        await page.click(f"{row} button.revoke")
        await page.wait_for_function(f"() => document.querySelector('{row} .state').textContent === 'revoked'")
        assert await page.locator(f"{row} button.revoke").count() == 0
        assert await complete(h, secret) == 401
        await page.screenshot(path=str(ARTIFACTS / "inspector-orgs-revoked.png"), full_page=True)
