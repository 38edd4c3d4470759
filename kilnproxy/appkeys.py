"""The typed keys of the aiohttp application, in one place."""

from aiohttp import web

from .gateway import Gateway

GATEWAY = web.AppKey("gateway", Gateway)
