"""The portal's files (/portal/, docs/portal.md) over raw HTTP: served to anyone, without a key, with the
inspector's security headers on every answer, refusals included; no inline script or style to allow; served
when the inspector is off; and the org API it reads sends no CORS header that would let another site read it."""

from html.parser import HTMLParser
from pathlib import Path

import pytest
from rawhttp import exchange, request

import kilnproxy.inspector

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "x-frame-options": "DENY",
            "referrer-policy": "no-referrer"}
FILES = {
    "/portal/": "text/html; charset=utf-8",
    "/portal/static/portal.js": "text/javascript; charset=utf-8",
    "/portal/static/portal.css": "text/css; charset=utf-8",
    "/portal/static/style.css": "text/css; charset=utf-8",
    "/portal/static/money.js": "text/javascript; charset=utf-8",
    "/portal/static/vendor/chart.umd.min.js": "text/javascript; charset=utf-8",
}
INSPECTOR = Path(kilnproxy.inspector.__file__).parent


async def get(h, path, method="GET", headers=None):
    """A request from afar (another ``Host``: not a local request): the pages need no key."""
    answer = await exchange(h.url, request(method, path, headers, host="portal.example.com"))
    return answer.status, answer.headers, answer.body


@pytest.mark.parametrize("inspector", [{"token": "ui-secret"}, {"enabled": False}])
async def test_every_file_is_served_to_anyone_with_the_security_headers(harness, inspector):
    async with harness(overrides={"inspector": inspector}) as h:
        for path, content_type in FILES.items():
            status, headers, body = await get(h, path)
            assert (status, headers["content-type"], headers["cache-control"]) == (200, content_type, "no-cache"), path
            assert {k: headers[k] for k in SECURITY} == SECURITY, path
            assert "set-cookie" not in headers and "access-control-allow-origin" not in headers
            name = "index.html" if path == "/portal/" else path.removeprefix("/portal/static/")
            mine = INSPECTOR / "portal_static" / name
            assert body == (mine if mine.exists() else INSPECTOR / "static" / name).read_bytes(), path
            again = await get(h, path, headers={"If-None-Match": headers["etag"]})
            assert (again[0], again[2]) == (304, b"")
        status, headers, body = await get(h, "/portal")
        assert (status, headers["location"]) == (302, "/portal/")
        assert headers["content-security-policy"] == CSP
        # the inspector's own pages are not the portal's: nothing under /portal/static/ but its files
        for path, status, code in [("/portal/static/app.js", 404, b'"not_found"'),
                                   ("/portal/static/orgs.js", 404, b'"not_found"'),
                                   ("/portal/static/../../ui/static/app.js", 404, b'"not_found"'),
                                   ("/portal/api/keys", 404, b'"not_found"'),
                                   ("/portal/index.html", 404, b'"not_found"')]:
            answer = await get(h, path)
            assert (answer[0], code in answer[2]) == (status, True), path
            assert {k: answer[1][k] for k in SECURITY} == SECURITY, path
            assert answer[1]["cache-control"] == "no-store"
        refused = await get(h, "/portal/", method="POST")
        assert (refused[0], b'"method_not_allowed"' in refused[2]) == (405, True)
        assert {k: refused[1][k] for k in SECURITY} == SECURITY
        if inspector.get("enabled") is False:
            assert (await get(h, "/ui/"))[0] == 404


class Markup(HTMLParser):
    """Every script's src, and anything a strict CSP would refuse: inline script, style elements and
    attributes, event handler attributes, javascript: links."""

    def __init__(self):
        super().__init__()
        self.sources, self.inline, self.open = [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.open = tag
        if tag == "script":
            self.sources.append(attrs.get("src"))
        if tag == "style":
            self.inline.append("<style>")
        for name, value in attrs.items():
            if name == "style" or name.startswith("on") or (value or "").strip().startswith("javascript:"):
                self.inline.append(f"{tag} {name}")

    def handle_data(self, data):
        if self.open == "script" and data.strip():
            self.inline.append(f"script: {data.strip()[:40]}")

    def handle_endtag(self, tag):
        self.open = None


async def test_the_page_has_nothing_inline(harness):
    async with harness() as h:
        markup = Markup()
        markup.feed((await get(h, "/portal/"))[2].decode())
        assert markup.inline == []
        assert markup.sources == ["/portal/static/vendor/chart.umd.min.js", "/portal/static/money.js",
                                  "/portal/static/portal.js"]
        script = (INSPECTOR / "portal_static" / "portal.js").read_text()
        for unsafe in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "localStorage",
                       "sessionStorage", "document.cookie"):
            assert unsafe not in script, unsafe
