"""Per-org admission state (request rule 5 (docs/reference.md)): requests in flight, credit holds, credits.

``Admission`` is what the request path needs at step 5: ``admit`` takes the
org's in-flight slot and places the request's ``Hold`` on its credits in one
step, or refuses with the documented 429 or 402 (the org's credits, or a key's
``limit`` in its period, held the same way: 402 ``key_limit_exceeded``); ``release`` gives both back once
the request's row has been submitted (the row's cost then replaces the hold).
``LocalAdmission`` keeps them in this process (the SQLite set-up);
``kilnproxy.store.postgres.store.PostgresStore`` keeps them in PostgreSQL, shared by
every replica.

``admit`` is awaited (a shared store needs a round trip), while ``release``
must not block or raise: it runs in the request's ``finally``, possibly while
the handler is being cancelled.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from ..errors import GatewayError
from ..usage import MAX_TOKENS, choice_count, prompt_count, prompt_token_bound
from .minute_windows import MinuteWindows


class Hold:
    """The most one request can cost: a bound on its prompt's tokens (``prompt_token_bound``: its UTF-8
    bytes plus a chat template's tokens, at most the context window) at the prompt price, plus
    ``max_tokens`` (at most the model's ``context_window``, the window when absent: ``output_bound``) for
    each choice it asks for (``n``, ``best_of``, and each prompt of a list) at the completion price;
    ``completion``, ``prompts`` (the prompts the window bounds one by one) or the ``prompt`` bound itself
    given, for the APIs that count them otherwise. ``amount`` is held against the org's credits and the
    key's ``limit``, ``tokens`` reserved against ``tokens_per_minute``. ``tokens`` and ``prompt_tokens``
    are at most ``MAX_TOKENS`` (``max_tokens`` × ``n`` × the prompts of a list could pass 2**64), what
    PostgreSQL's BIGINT and the JSON of its admission batch hold many times over.

    It also carries what a ``replica_lost`` row needs, should its replica die: ``prompt_tokens`` and
    ``prompt_cost``, the prompt part of the hold (its bound), what such a row is charged.
    """

    __slots__ = ("id", "org", "key_id", "model", "endpoint", "stream", "created_at", "pricing",
                 "amount", "key_limit", "key_since", "tokens", "per_minute", "prompt_tokens")

    def __init__(self, call: Any, created_at: str, body: Mapping[str, Any], context_window: int | None,
                 completion: int | None = None, prompts: int | None = None, prompt: int | None = None):
        self.id = call.generation_id
        self.org = call.org
        self.key_id = call.key_id
        self.model = call.model
        self.endpoint = call.endpoint
        self.stream = int(body.get("stream") in (True, "true", 1))
        self.created_at = created_at
        self.pricing = pricing = call.pricing
        if completion is None:
            completion = output_bound(_max_tokens(body), context_window)
            completion *= choice_count(body) * prompt_count(body)
        if prompt is None:
            prompt = prompt_token_bound(body, context_window, prompts)
        self.prompt_tokens = prompt = min(prompt, MAX_TOKENS)  # a window in the config may be any size
        self.amount = pricing.cost(prompt, completion, 0) if pricing else 0.0
        # reserved against tokens_per_minute bounds, and stored (PostgreSQL's BIGINT): capped, not refused (a
        # usage count is at most MAX_TOKENS: such a reservation already passes any bound a real request
        # meets, and the row replaces it); the amount is not: a float, it holds what a huge request could cost
        self.tokens = min(prompt + completion, MAX_TOKENS)
        # (window name, requests_per_minute, tokens_per_minute) of the org and key, when they have any
        self.per_minute: list[tuple[str, int | None, int | None]] = []
        self.key_limit: float | None = None  # the key's USD limit in its period starting at key_since
        self.key_since: str | None = None

    @property
    def prompt_cost(self) -> float:
        return self.pricing.cost(self.prompt_tokens, 0, 0) if self.pricing else 0.0


def output_bound(limit: int | None, context_window: int | None) -> int:
    """The most tokens one answer can have: the ``limit`` it asks for (``max_tokens`` and the like), at most
    the model's ``context_window`` (vLLM and llama.cpp fit prompt and output in the window: they refuse or cut
    an answer beyond it), the window itself without a limit; 0 knowing neither. The window is not lessened
    by the prompt's bound: the prompt may be shorter than its bound, which would leave room for more output.
    At most ``MAX_TOKENS``: a body's integer is read whole, and a limit near a double's own would make the
    hold's amount ``inf`` (and the org's holds ``nan`` once it is given back)."""
    if context_window and (limit is None or limit > context_window):
        return context_window
    return min(limit, MAX_TOKENS) if limit else 0


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    """The larger of ``max_tokens`` and ``max_completion_tokens``: vLLM's chat generates the second when both
    are given, other servers the first. None (no limit known) when neither is given, or when one is given but
    is not an integer >= 0, which a server may still read as a number ("100", 100.0) or as no limit (-1)."""
    limit = None
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if type(value) is not int or value < 0:
            return None
        limit = value if limit is None else max(limit, value)
    return limit


def rate_limited(org: str, limit: int) -> GatewayError:
    return GatewayError(429, "rate_limit_exceeded", f"Org `{org}` already has {limit} requests in flight.",
                        type="rate_limit_error")


def per_minute_exceeded(window: str) -> GatewayError:
    who, _, name = window.partition(":")
    return GatewayError(429, "rate_limit_exceeded",
                        f"{'Org' if who == 'org' else 'API key'} `{name}` has reached its requests or tokens per "
                        "minute; retry later.", type="rate_limit_error")


def key_limit_exceeded(key_id: str, limit: float) -> GatewayError:
    return GatewayError(402, "key_limit_exceeded",
                        f"API key `{key_id}` has used its limit of {limit:g} USD for this period (requests in "
                        "flight included). Ask the gateway's operator to raise it.", type="insufficient_credits")


def insufficient_credits(org: str, holding: bool = False) -> GatewayError:
    why = " once the requests it has in flight are paid for" if holding else ""
    return GatewayError(402, "insufficient_credits",
                        f"Org `{org}` has no credits left{why}. Ask the gateway's operator to raise its grant.",
                        type="insufficient_credits")


class Admission(Protocol):
    async def admit(self, hold: Hold, limit: int) -> None:
        """Take a slot of ``hold.org`` and place ``hold``, or raise ``GatewayError``: 429 when
        the org has ``limit`` requests in flight, 402 when its remaining credits minus its
        other holds are not above zero (503 ``store_unavailable`` for a store out of reach).
        Cancelled while waiting, it leaves nothing taken."""

    def release(self, hold: Hold) -> None:
        """The request's row was submitted: free its slot and its hold. Called exactly once
        per admitted hold, on every path; never blocks, never raises."""

    async def rehold(self, hold: Hold, new: Hold) -> None:
        """Optional: re-place admitted ``hold`` as ``new`` (the same request at a fallback model's
        prices), keeping its slot, or raise the 402 ``admit`` would (then ``hold`` stays as it was).
        Without it, a fallback keeps the hold placed at admission."""

    def settled(self, hold: Hold | None, row: Mapping[str, Any]) -> None:
        """The request's ``row`` was submitted (called before ``release``, on every request): an
        admission that keeps keys' spending or per-minute windows itself charges them here; one whose
        store does that with the row (PostgreSQL) does nothing."""

    def held(self, org: str) -> float:
        """USD this process holds in memory for ``org``'s requests in flight (the org views' ``held``
        on SQLite); 0.0 for an admission whose holds are in its store (PostgreSQL: ``books.held_by_org``)."""

    def count(self, org: str) -> int:
        """Requests of ``org`` this process has in flight (for metrics and tests)."""

    def snapshot(self) -> dict[str, int]:
        """``count`` of every org with requests in flight."""


class Credits:
    """Granted credits come from the config; spending is the ledger's ``SUM(cost)``.

    ``spent`` is loaded from the ledger at start-up and kept current by
    ``charge`` as rows are submitted (and, with a shared store, by what the
    store reports), so the check of step 1 costs no query. Raising a grant in
    the config never resets spending: spending lives in the ledger.
    """

    def __init__(self, granted: dict[str, float], spent: dict[str, float]):
        self.granted = dict(granted)
        self.spent: dict[str, float] = {}
        self.load(spent)

    def load(self, spent: Mapping[str, float]) -> None:
        self.spent = {org: spent.get(org, 0.0) for org in set(self.granted) | set(spent)}

    def remaining(self, org: str) -> float:
        return self.granted.get(org, 0.0) - self.spent.get(org, 0.0)

    def charge(self, org: str, cost: float) -> None:
        if cost:
            self.spent[org] = self.spent.get(org, 0.0) + cost


class Counts:
    """Requests of each org in flight in this process: ``count`` and ``snapshot`` of ``Admission``."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def taken(self, org: str) -> None:
        self._counts[org] = self._counts.get(org, 0) + 1

    def given_back(self, org: str) -> int:
        """One fewer in flight; returns how many are left."""
        n = self._counts[org] - 1
        if n:
            self._counts[org] = n
        else:
            del self._counts[org]
        return n

    def count(self, org: str) -> int:
        return self._counts.get(org, 0)

    def snapshot(self) -> dict[str, int]:
        return dict(self._counts)


class KeySpending:
    """What each key with a ``limit`` spent in its current period, in this process: loaded from the
    ledger when the key is first limited, then kept by ``charge`` as rows are submitted."""

    def __init__(self) -> None:
        self._spent: dict[str, tuple[str, float]] = {}  # key id -> (period start, USD since then)

    def known(self, key_id: str, since: str) -> bool:
        return key_id in self._spent and self._spent[key_id][0] == since

    def load(self, key_id: str, since: str, spent: float) -> None:
        self._spent[key_id] = (since, spent)

    def spent(self, key_id: str, since: str) -> float:
        """USD since ``since``; a period that has just begun starts at zero."""
        start, spent = self._spent.get(key_id, (since, 0.0))
        if start != since:
            self._spent[key_id] = (since, 0.0)
            return 0.0
        return spent

    def charge(self, key_id: str, since: str | None, cost: float) -> None:
        if since is not None and cost:
            self._spent[key_id] = (since, self.spent(key_id, since) + cost)


class LocalAdmission(Counts):
    """Slots and holds of this process (one gateway on SQLite)."""

    def __init__(self, credits: Credits) -> None:
        super().__init__()
        self.credits = credits
        self.key_spending = KeySpending()
        self.minutes = MinuteWindows()
        self._held: dict[str, float] = {}
        self._key_held: dict[str, float] = {}

    async def admit(self, hold: Hold, limit: int) -> None:
        org = hold.org
        in_flight = self._counts.get(org, 0)
        if in_flight >= limit:
            raise rate_limited(org, limit)
        if hold.per_minute and (window := self.minutes.full(hold.per_minute)) is not None:
            raise per_minute_exceeded(window)
        held = self._held.get(org, 0.0)
        if self.credits.remaining(org) - held <= 0:
            raise insufficient_credits(org, holding=True)
        if hold.key_limit is not None:
            spent = self.key_spending.spent(hold.key_id, hold.key_since)
            if hold.key_limit - spent - self._key_held.get(hold.key_id, 0.0) <= 0:
                raise key_limit_exceeded(hold.key_id, hold.key_limit)
            self._key_held[hold.key_id] = self._key_held.get(hold.key_id, 0.0) + hold.amount
        if hold.per_minute:
            self.minutes.take(hold.id, hold.tokens, [name for name, _, _ in hold.per_minute])
        self._counts[org] = in_flight + 1  # taken (Counts)
        self._held[org] = held + hold.amount

    def release(self, hold: Hold) -> None:
        if self.given_back(hold.org):
            self._held[hold.org] -= hold.amount
        else:
            del self._held[hold.org]  # no float residue left behind once the org is idle
        if hold.key_limit is not None:
            left = self._key_held[hold.key_id] - hold.amount
            if left > 1e-12:
                self._key_held[hold.key_id] = left
            else:
                del self._key_held[hold.key_id]

    async def rehold(self, hold: Hold, new: Hold) -> None:
        """``hold`` becomes ``new`` (a fallback's prices), checked as ``admit`` checks a new hold."""
        org = hold.org
        if self.credits.remaining(org) - (self._held[org] - hold.amount) <= 0:
            raise insufficient_credits(org, holding=True)
        if hold.key_limit is not None:
            spent = self.key_spending.spent(hold.key_id, hold.key_since)
            if hold.key_limit - spent - (self._key_held[hold.key_id] - hold.amount) <= 0:
                raise key_limit_exceeded(hold.key_id, hold.key_limit)
            self._key_held[hold.key_id] += new.amount - hold.amount
        self._held[org] += new.amount - hold.amount

    def settled(self, hold: Hold | None, row: Mapping[str, Any]) -> None:
        """The request's row: its cost charged to its key's period, its tokens to its windows."""
        if hold is None:
            return
        if hold.key_limit is not None:
            self.key_spending.charge(row["key_id"], hold.key_since, row["cost"])
        if hold.per_minute:
            self.minutes.settle(hold.id, row["total_tokens"])

    def held(self, org: str) -> float:
        return self._held.get(org, 0.0)
