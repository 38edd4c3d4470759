"""The response rules (docs/reference.md) for non-streamed answers, as a ``transform_response`` plugin:
``model`` becomes the catalog id and ``usage.cost`` is added (to the usage object of the
endpoint's own format: OpenAI's, the Responses API's or Anthropic's; one of zeros when the
upstream sent none, as the row counts none).

(Streamed chunks get the same treatment from the relay at byte level, so that
events nobody changes are forwarded without being parsed.)
"""

from ...hookspecs import hookimpl
from ...usage import Usage


# The usage object of an answer whose upstream sent none (or not an object): what the gateway counted, nothing.
NO_USAGE = {"responses": ("input_tokens", "output_tokens", "total_tokens"),
            "messages": ("input_tokens", "output_tokens")}
OPENAI_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


@hookimpl(tryfirst=True)
def transform_response(call, body):
    body["model"] = call.model
    usage = body.get("usage")
    if isinstance(usage, dict):
        usage["cost"] = Usage.of_endpoint(call.endpoint, usage).cost(call.pricing)
    else:
        body["usage"] = {**dict.fromkeys(NO_USAGE.get(call.endpoint, OPENAI_COUNTS), 0), "cost": 0.0}
