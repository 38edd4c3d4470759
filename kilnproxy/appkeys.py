"""The typed keys of the aiohttp application, in one place."""

from aiohttp import web

from .gateway import Gateway

GATEWAY = web.AppKey("gateway", Gateway)
# (method, raw path) -> handler, for the low-level server's route table (kilnproxy.fastpath)
HOT_ROUTES = web.AppKey("hot_routes", dict)
