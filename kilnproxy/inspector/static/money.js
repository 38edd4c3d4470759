// Money on every page (the inspector's and the portal's), written one way: US dollars in plain decimal,
// never in exponent notation. Two decimals (cents); when an amount needs more decimals to show three
// significant digits, as many as that takes (at most MONEY_MAX_DECIMALS), without trailing zeros past
// the cents. So: $125.00, $2.50, $0.123, $0.0123, $0.0000037, $0.0000002; -$2.50; a comma between
// thousands ($12,500.00); "–" for none (null). docs/inspector.md states the rule.
"use strict";

const MONEY_MAX_DECIMALS = 12;  // $0.000000000001: below that, an amount is written $0.00
const moneyFormats = new Map();  // decimals -> its Intl.NumberFormat (standard notation: never an exponent)

function money(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  const size = Math.abs(value);
  const decimals = size === 0 ? 2 : Math.min(MONEY_MAX_DECIMALS, Math.max(2, 2 - Math.floor(Math.log10(size))));
  if (!moneyFormats.has(decimals)) {
    moneyFormats.set(decimals, new Intl.NumberFormat("en-US", {
      minimumFractionDigits: decimals, maximumFractionDigits: decimals, useGrouping: true }));
  }
  let text = moneyFormats.get(decimals).format(size);
  if (decimals > 2) text = text.replace(/(\.\d\d\d*?)0+$/, "$1");  // 0.00000370 -> 0.0000037; 0.500 -> 0.50
  return `${value < 0 && text.match(/[1-9]/) ? "-" : ""}$${text}`;
}
