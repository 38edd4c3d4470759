"""A plugin that implements every hook and does nothing: the price of a hook being implemented (M6)."""

from kilnproxy import hookimpl


@hookimpl
def startup(gateway):
    pass


@hookimpl
def shutdown(gateway):
    pass


@hookimpl
def check_request(call, body):
    return None


@hookimpl
def rewrite_request(call, body):
    pass


@hookimpl
def transform_event(call, event):
    pass


@hookimpl
def transform_response(call, body):
    pass


@hookimpl
def response_headers(call):
    return None


@hookimpl
def record_usage(call, usage):
    pass
