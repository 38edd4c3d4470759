"""Version 15 of the PostgreSQL schema: ``usage_daily``, the rollup the spend query reads
(``kilnproxy.store.spend``), built from the rows already there and kept in step by triggers.

One rollup row per ``(day, org, key_id, model)`` (``day``: the first 10 characters of
``created_at``; ``model``: "" for a row without one), as in the SQLite file
(``kilnproxy.store.sqlite.spend_rollup``): the count of rows, the sums of their tokens, and of their
cost in whole ten-billionths of a dollar (``round(cost * 1e10)``, exact in any order), keyed in the
same order, ``(day, model, org, key_id)``. The figures are NUMERIC: no sum, however large (a count at its
cap of 2**53 - 1, a cost past 2**63 units), can make a settlement fail and its rows wait in the spool.

Statement-level triggers on ``usage_events`` read the statement's rows (transition tables) and add
them up per rollup row in one upsert: a settlement of a batch (``kiln_settle``, a ``replica_lost``
row replaced included), a reap (``kiln_reap``), ``import-ledger`` (which settles through
``kiln_settle``), a ``COPY`` or a hand-made change all keep the rollup in step, in their own
transaction. The upsert takes the rollup rows in the order of their keys: two settlements never
wait for each other in opposite orders. A settlement already holds its orgs' ``kiln_orgs`` rows, so
two replicas' settlements of one org queued before; the rollup adds no wait between other orgs.
"""

_COLUMNS = "day, org, key_id, model, requests, prompt_tokens, completion_tokens, cached_tokens, cost_units"
_ROW = ("substr({r}.created_at, 1, 10) AS day, {r}.org, {r}.key_id, coalesce({r}.model, '') AS model,"
        " {sign} AS requests, {sign} * {r}.prompt_tokens AS prompt_tokens,"
        " {sign} * {r}.completion_tokens AS completion_tokens, {sign} * {r}.cached_tokens AS cached_tokens,"
        " {sign} * round({r}.cost * 10000000000)::NUMERIC AS cost_units")
_UPSERT = f"""
    INSERT INTO usage_daily AS d ({_COLUMNS})
    SELECT c.day, c.org, c.key_id, c.model, sum(c.requests), sum(c.prompt_tokens), sum(c.completion_tokens),
           sum(c.cached_tokens), sum(c.cost_units)
      FROM ({{rows}}) c
     GROUP BY c.day, c.org, c.key_id, c.model
    HAVING sum(c.requests) <> 0 OR sum(c.prompt_tokens) <> 0 OR sum(c.completion_tokens) <> 0
        OR sum(c.cached_tokens) <> 0 OR sum(c.cost_units) <> 0
     ORDER BY c.day, c.model, c.org, c.key_id
    ON CONFLICT (day, model, org, key_id) DO UPDATE SET
        requests = d.requests + EXCLUDED.requests, prompt_tokens = d.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = d.completion_tokens + EXCLUDED.completion_tokens,
        cached_tokens = d.cached_tokens + EXCLUDED.cached_tokens, cost_units = d.cost_units + EXCLUDED.cost_units;
"""
_ADDED = "SELECT " + _ROW.format(r="n", sign="1") + " FROM kiln_new_rows n"
_TAKEN = "SELECT " + _ROW.format(r="o", sign="-1") + " FROM kiln_old_rows o"

V15 = f"""
CREATE TABLE usage_daily (
    day TEXT NOT NULL,
    org TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    requests NUMERIC NOT NULL,
    prompt_tokens NUMERIC NOT NULL,
    completion_tokens NUMERIC NOT NULL,
    cached_tokens NUMERIC NOT NULL,
    cost_units NUMERIC NOT NULL,
    PRIMARY KEY (day, model, org, key_id)
);
CREATE INDEX usage_daily_org_day ON usage_daily (org, day);

INSERT INTO usage_daily ({_COLUMNS})
SELECT substr(u.created_at, 1, 10), u.org, u.key_id, coalesce(u.model, ''), count(*), sum(u.prompt_tokens),
       sum(u.completion_tokens), sum(u.cached_tokens), sum(round(u.cost * 10000000000)::NUMERIC)
  FROM usage_events u GROUP BY 1, 2, 3, 4;

CREATE FUNCTION kiln_usage_daily_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {_UPSERT.format(rows=_ADDED)}
    RETURN NULL;
END $$;

CREATE FUNCTION kiln_usage_daily_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {_UPSERT.format(rows=_TAKEN)}
    RETURN NULL;
END $$;

CREATE FUNCTION kiln_usage_daily_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {_UPSERT.format(rows=_ADDED + " UNION ALL " + _TAKEN)}
    RETURN NULL;
END $$;

CREATE TRIGGER usage_daily_insert AFTER INSERT ON usage_events REFERENCING NEW TABLE AS kiln_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION kiln_usage_daily_inserted();
CREATE TRIGGER usage_daily_delete AFTER DELETE ON usage_events REFERENCING OLD TABLE AS kiln_old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION kiln_usage_daily_deleted();
CREATE TRIGGER usage_daily_update AFTER UPDATE ON usage_events
    REFERENCING OLD TABLE AS kiln_old_rows NEW TABLE AS kiln_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION kiln_usage_daily_updated();
"""
