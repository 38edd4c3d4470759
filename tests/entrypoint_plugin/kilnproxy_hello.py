"""kilnproxy-hello: a plugin that greets, installed through the ``kilnproxy`` entry point.

It is installed into the test environment, so it must be harmless to every
other test: it does nothing unless ``[plugins.settings.hello] greeting`` is
set, and then adds ``X-Hello: <greeting>`` to each completion response.
"""

from kilnproxy import hookimpl


@hookimpl
def response_headers(call):
    greeting = call.settings("hello").get("greeting")
    return {"X-Hello": greeting} if greeting else None
