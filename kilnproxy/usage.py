"""Token counts, their price, and estimates for requests cut short."""

from __future__ import annotations

from typing import Any, Mapping

from .config import Pricing

# USD amounts are rounded to this many decimals wherever they are computed, so that answers,
# rows and logs show 1.6e-06 and not 1.6000000000000001e-06 (a ten-billionth of a dollar is far
# below any price per token).
COST_DECIMALS = 10

# The columns of a usage row (table ``usage_events``), in the order every store keeps them.
COLUMNS = (
    "id", "created_at", "org", "key_id", "model", "endpoint", "stream", "status",
    "error_code", "prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens",
    "cost", "duration_ms", "ttft_ms", "finish_reason", "disconnected", "requested_model", "upstream",
    "batch_id",
)


def round_usd(amount: float) -> float:
    return round(amount, COST_DECIMALS)


class Usage:
    """Final token counts of one request, as the upstream reported them."""

    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "total_tokens")

    def __init__(self, prompt_tokens: int = 0, completion_tokens: int = 0,
                 cached_tokens: int = 0, total_tokens: int | None = None):
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens
        if total_tokens is None:
            total_tokens = prompt_tokens + completion_tokens
            if total_tokens > MAX_TOKENS:
                total_tokens = MAX_TOKENS
        self.total_tokens = total_tokens

    @classmethod
    def from_upstream(cls, usage: Mapping[str, Any]) -> "Usage":
        """Read an OpenAI-style ``usage`` object; missing or odd fields count as 0, a count above
        ``MAX_TOKENS`` as ``MAX_TOKENS``."""
        get = usage.get  # _count in line: read on every stream's usage
        details = get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        prompt, completion, total = get("prompt_tokens"), get("completion_tokens"), get("total_tokens")
        return cls((prompt if prompt <= MAX_TOKENS else MAX_TOKENS) if type(prompt) is int and prompt > 0 else 0,
                   (completion if completion <= MAX_TOKENS else MAX_TOKENS)
                   if type(completion) is int and completion > 0 else 0,
                   (cached if cached <= MAX_TOKENS else MAX_TOKENS) if type(cached) is int and cached > 0 else 0,
                   (total if total <= MAX_TOKENS else MAX_TOKENS)
                   if type(total) is int and total >= 0 else None)  # as reported; else p + c

    @classmethod
    def of_endpoint(cls, endpoint: str, usage: Mapping[str, Any]) -> "Usage":
        """Read the usage object of an endpoint's own format: OpenAI's ``prompt_tokens`` (completions,
        embeddings), the Responses API's ``input_tokens``/``output_tokens``, or Anthropic's, whose
        prompt is ``input_tokens`` plus the cache reads and writes (the reads are the cached part)."""
        if endpoint == "responses":
            details = usage.get("input_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else 0
            return cls(_count(usage.get("input_tokens")), _count(usage.get("output_tokens")), _count(cached))
        if endpoint == "messages":
            read = _count(usage.get("cache_read_input_tokens"))
            prompt = _count(usage.get("input_tokens")) + read + _count(usage.get("cache_creation_input_tokens"))
            return cls(min(prompt, MAX_TOKENS), _count(usage.get("output_tokens")), read)
        return cls.from_upstream(usage)

    @classmethod
    def combined(cls, reports: list["Usage"]) -> "Usage":
        """One request's usage from one report per choice (llama.cpp with ``n`` > 1), in OpenAI's
        form: the completions added up (at most ``MAX_TOKENS``), the prompt counted once (its cached
        part as the least any choice reported)."""
        if len(reports) == 1:
            return reports[0]
        return cls(max(r.prompt_tokens for r in reports), min(sum(r.completion_tokens for r in reports), MAX_TOKENS),
                   min(r.cached_tokens for r in reports))

    def is_zero(self) -> bool:
        return not (self.prompt_tokens or self.completion_tokens or self.total_tokens)

    def cost(self, pricing: Pricing | None) -> float:
        """USD, rounded to ``COST_DECIMALS``: what the answer shows and the row records."""
        if pricing is None:
            return 0.0
        return round_usd(pricing.cost(self.prompt_tokens, self.completion_tokens, self.cached_tokens))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Usage) and (
            self.prompt_tokens == other.prompt_tokens and self.completion_tokens == other.completion_tokens
            and self.cached_tokens == other.cached_tokens and self.total_tokens == other.total_tokens)

    def __repr__(self) -> str:
        return ("Usage(prompt={0.prompt_tokens}, completion={0.completion_tokens}, "
                "cached={0.cached_tokens}, total={0.total_tokens})").format(self)


# The most a usage count is, wherever the gateway reports or stores one (docs/reference.md, the usage
# table): the largest integer every JSON client reads exactly; a larger count an upstream reports is
# taken as this one, so that no count nor sum of a request's counts leaves a 64-bit column.
MAX_TOKENS = 2**53 - 1


def _count(value: Any) -> int:
    return (value if value <= MAX_TOKENS else MAX_TOKENS) if type(value) is int and value > 0 else 0


def cap_counts(usage: dict) -> None:
    """The usage object the client gets says what the row records: each count an upstream reported
    above ``MAX_TOKENS`` (an integer, in the object or in one it holds, e.g.
    ``prompt_tokens_details``) becomes ``MAX_TOKENS``, in place. Anything else (a negative count, a
    string, a float) is left as it came."""
    for name, value in usage.items():
        if type(value) is int:
            if value > MAX_TOKENS:
                usage[name] = MAX_TOKENS
        elif isinstance(value, dict):
            for inner, count in value.items():
                if type(count) is int and count > MAX_TOKENS:
                    value[inner] = MAX_TOKENS


CHARS_PER_TOKEN = 4  # the usual rule of thumb for English text and BPE tokenizers


def estimate_prompt_tokens(body: Mapping[str, Any] | None) -> int:
    """A rough prompt size for a request the upstream never reported on.

    Used only when the client left before the upstream sent its usage: about
    four characters a token over the prompt, the messages' text or the ``input``
    (with a ``system`` prompt or ``instructions``), at least 1.
    A token-id prompt (a list of ints) counts one token per id.
    """
    if not body:
        return 0
    chars = 0
    ids = 0
    source = next((body[k] for k in ("prompt", "messages", "input") if body.get(k) is not None), None)
    stack = [source, body.get("system"), body.get("instructions")]  # Anthropic's and the Responses API's own
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            ids += 1
        elif isinstance(item, list):
            if all(type(x) is int for x in item):  # token ids: one token each
                ids += len(item)
            else:
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(v for k, v in item.items() if k in ("content", "text", "input"))
    return max(1, ids + -(-chars // CHARS_PER_TOKEN))


# The hold's bound on a prompt (``prompt_token_bound``): a BPE token is at least one UTF-8 byte, so a
# text's byte length bounds its tokens whatever the tokenizer; a chat template adds a few tokens around
# each message (ChatML's ``<|im_start|>user\n ... <|im_end|>\n`` is 5, Llama 3's header and ``<|eot_id|>``
# 5 too, the role's bytes included here): ``TEMPLATE_TOKENS_PER_MESSAGE`` is a safe allowance for them;
# ``TEMPLATE_TOKENS`` covers the rest (BOS, a default system prompt such as Llama 3.1's dated one, about
# 30 tokens with its frame, the generation prompt after the last message), and is added again for each
# field rendered as JSON, for the preamble a template puts before tool definitions. Those fields count
# twice their length: templates' ``tojson`` escapes non-ASCII text (6 bytes for a 3-byte character).
TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS = 64
_PROMPT_FIELDS = ("prompt", "messages", "input", "system", "instructions")
_RENDERED_AS_JSON = ("tools", "functions", "tool_choice", "documents")


def prompt_token_bound(body: Mapping[str, Any] | None, context_window: int | None = None,
                       prompts: int | None = None) -> int:
    """The most tokens the request's prompt can be, for any real tokenizer and chat template: the UTF-8
    bytes of every string in the fields that make the prompt (``prompt``, ``messages``, ``input``,
    ``system``, ``instructions``; tool definitions twice the bytes of their text), one token per token id,
    ``TEMPLATE_TOKENS_PER_MESSAGE`` per message (or per prompt of a list, or per input), plus
    ``TEMPLATE_TOKENS``; never more than ``context_window`` per prompt when the model has one (the
    upstream refuses a longer prompt). ``prompts``: how many prompts the body holds, each bounded by the
    window on its own (default ``prompt_count``; embeddings: ``input_count``).
    """
    if not body:
        return 0
    tokens = TEMPLATE_TOKENS
    for field in _PROMPT_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        if type(value) is str:  # the usual prompt: no walk
            tokens += len(value.encode("utf-8", "surrogatepass"))
            continue
        if isinstance(value, list):  # messages, prompts or inputs; a list of token ids is one prompt
            tokens += TEMPLATE_TOKENS_PER_MESSAGE * sum(not isinstance(item, int) for item in value)
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                tokens += len(item.encode("utf-8", "surrogatepass"))
            elif isinstance(item, int) and not isinstance(item, bool):
                tokens += 1
            elif isinstance(item, list):
                if all(type(x) is int for x in item):  # token ids (a batch's may be millions): one token each
                    tokens += len(item)
                else:
                    stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())
    for field in _RENDERED_AS_JSON:
        value = body.get(field)
        if value is not None:
            tokens += 2 * len(repr(value).encode("utf-8", "surrogatepass")) + TEMPLATE_TOKENS
    if context_window:
        tokens = min(tokens, context_window * (prompt_count(body) if prompts is None else prompts))
    return tokens


def prompt_count(body: Mapping[str, Any]) -> int:
    """How many prompts a completions request sends (a list of strings or of token-id lists is one
    prompt each, every one answered with its own choices); 1 otherwise."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def input_count(body: Mapping[str, Any]) -> int:
    """How many inputs an embeddings request sends: a list of strings or of token-id lists is one input
    each (each embedded, and bounded by the context window, on its own); 1 otherwise."""
    value = body.get("input")
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return len(value)
    return 1


MAX_CHOICES = 1024  # n and best_of at most (OpenAI allows 128): a hold of more is beyond 64 bits of tokens


def choice_count(body: Mapping[str, Any]) -> int:
    """The choices a request asks the upstream to generate for each prompt: the larger of ``n`` and
    ``best_of`` (a whole number >= 1, ``2.0`` as 2; anything else counts as 1), at most ``MAX_CHOICES``.
    The completion endpoints refuse any other value, after the hold (``rules.check_choices``)."""
    count = 1
    for name in ("n", "best_of"):
        value = body.get(name)
        if type(value) is int and value > count:
            count = value
        elif type(value) is float and value.is_integer() and value > count:
            count = int(min(value, MAX_CHOICES))
    return min(count, MAX_CHOICES)
