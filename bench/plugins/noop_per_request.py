"""Every hook but ``transform_event``, doing nothing: the price of the once-per-request hooks (M6)."""

from kilnproxy import hookimpl


@hookimpl
def check_request(call, body):
    return None


@hookimpl
def rewrite_request(call, body):
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
