"""The response rules (docs/reference.md) for non-streamed answers, as a ``transform_response`` plugin:
``model`` becomes the catalog id and ``usage.cost`` is added (to the usage object of the
endpoint's own format: OpenAI's, the Responses API's or Anthropic's).

(Streamed chunks get the same treatment from the relay at byte level, so that
events nobody changes are forwarded without being parsed.)
"""

from ...hookspecs import hookimpl
from ...usage import Usage


@hookimpl(tryfirst=True)
def transform_response(call, body):
    body["model"] = call.model
    usage = body.get("usage")
    if isinstance(usage, dict):
        usage["cost"] = Usage.of_endpoint(call.endpoint, usage).cost(call.pricing)
