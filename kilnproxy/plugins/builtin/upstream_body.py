"""The body rules of the request rules (docs/reference.md), steps 8 and 9, as a ``rewrite_request`` plugin.

The upstream gets the model's ``upstream_model`` as ``model`` and, on a
streamed completion, ``stream_options.include_usage = true`` so that every
stream is metered (the Responses and Messages APIs report usage in their streams anyway); the relay later removes the usage chunk when the client
did not ask for it (``call.include_usage``).
"""

from ...hookspecs import hookimpl


@hookimpl(tryfirst=True)
def rewrite_request(call, body):
    body["model"] = call.upstream_model
    if call.stream and call.endpoint in ("completions", "chat/completions"):  # the other APIs report usage anyway
        options = body.get("stream_options")
        body["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {
            "include_usage": True}
