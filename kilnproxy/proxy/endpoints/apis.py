"""The name ``kilnproxy.web.app`` imports the routes of embeddings, Responses and Messages by; they are
``api_routes``' (each API in its own module). To go once ``web/app.py`` imports ``api_routes``."""

from .api_routes import add_routes, hot_routes

__all__ = ["add_routes", "hot_routes"]
