"""kilnproxy: a self-hostable LLM gateway. Plugins import what they need from here."""

from .errors import GatewayError as Refusal
from .errors import KilnError
from .hookspecs import hookimpl
from .call import DROP, STOP, Call

__all__ = ["hookimpl", "Call", "Refusal", "STOP", "DROP", "KilnError"]
__version__ = "0.1.0"
