"""A plugin whose only hook is a ``transform_event`` that changes nothing: the price of having
one (M3), every event parsed and serialised again and nothing else."""

from kilnproxy import hookimpl


@hookimpl
def transform_event(call, event):
    pass
