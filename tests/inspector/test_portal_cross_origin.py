"""The portal and the org API seen from another origin's page, in Debian's chromium (docs/portal.md): a site the
admin visits reads nothing from the org API, with or without the key (the API sends no CORS header, and no
cookie exists to ride along), changes nothing with a request the browser sends blind, and cannot frame the
portal under a decoy. And raw: no answer of the org API carries an ``Access-Control-*`` header."""

from contextlib import asynccontextmanager

from aiohttp import web
from browser import chromium_page
from rawhttp import exchange, request

from kilnproxy.aiohttp_internals import site_sockets
from kilnproxy.testing import KEY

# In the other origin's page: each fetch of the org API, and what the script could read of it.
ATTEMPTS = """async ([gateway, key]) => {
  const bearer = { Authorization: `Bearer ${key}` };
  const attempt = async (path, init) => {
    try { const r = await fetch(gateway + path, init); return `read ${r.status} ${await r.text()}`; }
    catch (e) { return `refused ${e.name}`; }
  };
  return [
    await attempt("/v1/org", {}),
    await attempt("/v1/org", { credentials: "include" }),
    await attempt("/v1/org", { headers: bearer }),
    await attempt("/v1/org/keys", { headers: bearer, credentials: "include" }),
    await attempt("/v1/org/usage?group_by=day", { headers: bearer }),
    await attempt("/v1/org/keys", { method: "POST", headers: { ...bearer, "Content-Type": "application/json" },
                                    body: JSON.stringify({ name: "planted" }) }),
  ];
}"""
# A request the browser sends without asking (no-cors: a form's or an image's): it may reach the gateway, the
# script never sees the answer, and with no cookie and no way to add a header it carries no key.
BLIND = """async (gateway) => {
  const r = await fetch(gateway + "/v1/org/keys", { method: "POST", mode: "no-cors", credentials: "include",
                                                    headers: { "Content-Type": "text/plain" },
                                                    body: JSON.stringify({ name: "planted" }) });
  return [r.type, r.status];
}"""


def admins(config):
    config["keys"][0]["role"] = "admin"


@asynccontextmanager
async def other_origin(h):
    """A site on another port than the gateway's (another origin), whose page frames the portal."""
    async def decoy(request):
        return web.Response(content_type="text/html", text=(
            f'<p>win a prize</p><iframe id="portal" src="{h.url}/portal/" width="1200" height="600"></iframe>'
            '<script>document.getElementById("portal").addEventListener("load", () => { window.framed = true; });'
            '</script>'))

    app = web.Application()
    app.router.add_get("/", decoy)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://localhost:{site_sockets(site)[0].getsockname()[1]}/"
    finally:
        await runner.cleanup()


async def keys(h):
    async with h.session.get(f"{h.url}/v1/org/keys", headers=h.headers()) as resp:
        return (await resp.json())["data"]


async def test_another_origins_page_reads_nothing_and_changes_nothing(harness):
    async with harness(configure=admins) as h, chromium_page() as page, other_origin(h) as origin:
        before = await keys(h)
        await page.goto(origin)
        assert await page.evaluate(ATTEMPTS, [h.url, KEY]) == ["refused TypeError"] * 6
        assert await page.evaluate(BLIND, h.url) == ["opaque", 0]
        assert await keys(h) == before  # nothing planted, with or without the key

        # the portal in its frame: refused by its frame-ancestors 'none' (chromium shows its error page)
        await page.wait_for_function("() => window.framed === true")
        [frame] = [f for f in page.frames if f != page.main_frame]
        assert not frame.url.startswith(h.url)
        assert await frame.query_selector("#sign-in-form") is None
        page.kiln_errors[:] = [e for e in page.kiln_errors if "frame-ancestors 'none'" not in e]  # that refusal


async def test_no_answer_of_the_org_api_carries_a_cors_header(harness):
    async with harness(configure=admins) as h:
        origin = {"Origin": "http://evil.example"}
        preflight = {**origin, "Access-Control-Request-Method": "GET",
                     "Access-Control-Request-Headers": "authorization"}
        bearer = {**origin, "Authorization": f"Bearer {KEY}"}
        for method, path, headers, status in [
                ("OPTIONS", "/v1/org", preflight, 405), ("OPTIONS", "/v1/org/keys", preflight, 405),
                ("GET", "/v1/org", origin, 401), ("GET", "/v1/org", bearer, 200), ("GET", "/v1/org/keys", bearer, 200),
                ("GET", "/v1/org/usage", bearer, 200), ("GET", "/portal/", origin, 200)]:
            answer = await exchange(h.url, request(method, path, headers))
            assert answer.status == status, (method, path)
            assert [k for k in answer.headers if k.startswith("access-control-")] == [], (method, path)
            assert "set-cookie" not in answer.headers, (method, path)
