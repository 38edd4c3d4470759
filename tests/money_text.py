"""``written(amount)``: money as every page writes it (kilnproxy/inspector/static/money.js, docs/inspector.md),
computed here apart from the page's code, with ``decimal`` (halves away from zero, as Intl.NumberFormat): US dollars in plain decimal, two decimals, or as
many as three significant digits take (at most 12), no trailing zeros past the cents, ``-`` before ``$``,
commas between thousands, ``–`` for none."""

from decimal import ROUND_HALF_UP, Decimal

MAX_DECIMALS = 12


def written(amount: float | None) -> str:
    if amount is None:
        return "–"
    exact = Decimal(amount)  # the float's own value: the page rounds the same binary number
    size = abs(exact)
    decimals = 2 if size == 0 else min(MAX_DECIMALS, max(2, 2 - size.adjusted()))
    text = f"{size.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP):,f}"
    whole, fraction = text.split(".")
    fraction = fraction[:2] + fraction[2:].rstrip("0")
    sign = "-" if amount < 0 and any(c in "123456789" for c in text) else ""
    return f"{sign}${whole}.{fraction}"
