"""Calls to the admin API (``/admin/v1/...``) for tests: ``call(session, url, method, path, body)``
gives ``(status, JSON body)``; ``api(h)`` binds it to a running gateway's session and URL."""


NOTHING = object()


async def call(session, url, method, path, body=NOTHING, *, raw=None, headers=None):
    """``(status, JSON body)`` of one request."""
    kwargs = {"data": raw} if raw is not None else {} if body is NOTHING else {"json": body}
    async with session.request(method, f"{url}{path}", headers=headers, **kwargs) as resp:
        return resp.status, await resp.json()


def api(h):
    return lambda method, path, body=NOTHING, **kw: call(h.session, h.url, method, path, body, **kw)
