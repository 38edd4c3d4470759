"""Version 13 of the PostgreSQL schema: the Batch API (SPEC 14): its tables and the usage row's ``batch_id``.

The tables of files, their chunks, batches and their lines are
``kilnproxy.store.batch_api.tables``' (the same text as SQLite's, BYTEA for the
chunks). ``usage_events`` gains ``batch_id``: the batch whose line the request
ran, or NULL (any other request; the rows before this version). Adding a
nullable column with no default rewrites no row.

``kiln_settle`` is version 11's, reading ``batch_id`` from each incoming row
too. Same signature: a replica of the release before, during a rolling
upgrade, sends rows without the field, and ``jsonb_to_recordset`` gives it
NULL; ``kiln_reap``'s ``replica_lost`` rows leave it NULL (a line's runner
finds such a row by its generation id, ``kilnproxy.batches.job``).
"""

from ...batch_api.tables import POSTGRES_TABLES

V13 = POSTGRES_TABLES + """
ALTER TABLE usage_events ADD COLUMN batch_id TEXT;

-- Version 11's, the incoming rows' batch_id kept.
CREATE OR REPLACE FUNCTION kiln_settle(p_rows JSONB, p_replica TEXT)
RETURNS TABLE (r_org TEXT, r_spent DOUBLE PRECISION) LANGUAGE plpgsql AS $$
BEGIN
    -- (the ids as an array, not a join: a join is planned for 100 incoming rows, hashed against a
    -- sequential scan of the table; the array made in the statement, not passed in a variable, whose
    -- known length would have each call planned anew)
    DELETE FROM kiln_holds h WHERE h.id = ANY (ARRAY(SELECT i.id FROM jsonb_to_recordset(p_rows) AS i(id TEXT)));
    RETURN QUERY
    WITH incoming AS (
        SELECT x.id, x.created_at, x.org, x.key_id, x.model, x.endpoint, x.stream, x.status, x.error_code,
               x.prompt_tokens, x.completion_tokens, x.cached_tokens, x.total_tokens, x.cost, x.duration_ms,
               x.ttft_ms, x.finish_reason, x.disconnected, coalesce(x.requested_model, x.model) AS requested_model,
               x.upstream, x.batch_id
          FROM jsonb_to_recordset(p_rows) AS x(
            id TEXT, created_at TEXT, org TEXT, key_id TEXT, model TEXT, endpoint TEXT, stream INTEGER,
            status INTEGER, error_code TEXT, prompt_tokens BIGINT, completion_tokens BIGINT,
            cached_tokens BIGINT, total_tokens BIGINT, cost DOUBLE PRECISION, duration_ms DOUBLE PRECISION,
            ttft_ms DOUBLE PRECISION, finish_reason TEXT, disconnected INTEGER, requested_model TEXT,
            upstream TEXT, batch_id TEXT)
    ), lost AS (
        SELECT u.id, u.cost FROM usage_events u JOIN incoming i ON i.id = u.id
         WHERE u.error_code = 'replica_lost' AND i.error_code IS DISTINCT FROM 'replica_lost'
           FOR UPDATE OF u
    ), replaced AS (
        UPDATE usage_events u SET
            created_at = i.created_at, org = i.org, key_id = i.key_id, model = i.model, endpoint = i.endpoint,
            stream = i.stream, status = i.status, error_code = i.error_code, prompt_tokens = i.prompt_tokens,
            completion_tokens = i.completion_tokens, cached_tokens = i.cached_tokens,
            total_tokens = i.total_tokens, cost = i.cost, duration_ms = i.duration_ms, ttft_ms = i.ttft_ms,
            finish_reason = i.finish_reason, disconnected = i.disconnected, requested_model = i.requested_model,
            upstream = i.upstream, batch_id = i.batch_id, replica = p_replica
          FROM incoming i JOIN lost l ON l.id = i.id
         WHERE u.id = i.id
        RETURNING u.org, i.cost - l.cost AS delta
    ), inserted AS (
        INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status, error_code,
                                  prompt_tokens, completion_tokens, cached_tokens, total_tokens, cost,
                                  duration_ms, ttft_ms, finish_reason, disconnected, requested_model, upstream,
                                  batch_id, replica)
        SELECT i.*, p_replica FROM incoming i
        ON CONFLICT (id) DO NOTHING
        RETURNING usage_events.org, usage_events.cost AS delta
    ), deltas AS (
        SELECT d.org, sum(d.delta) AS delta FROM (SELECT * FROM replaced UNION ALL SELECT * FROM inserted) d
         GROUP BY d.org ORDER BY d.org
    )
    INSERT INTO kiln_orgs AS o (org, spent) SELECT d.org, d.delta FROM deltas d
    ON CONFLICT (org) DO UPDATE SET spent = o.spent + EXCLUDED.spent
    RETURNING o.org, o.spent;
    -- the entries locked in the order of their ids, as an admission takes those it drops (kiln_minute_full)
    PERFORM 1 FROM kiln_minute m
      WHERE m.id = ANY (ARRAY(SELECT j.id FROM jsonb_to_recordset(p_rows) AS j(id TEXT)))
      ORDER BY m.id FOR UPDATE;
    UPDATE kiln_minute m SET tokens = i.total_tokens
      FROM jsonb_to_recordset(p_rows) AS i(id TEXT, total_tokens BIGINT)
     WHERE m.id = ANY (ARRAY(SELECT j.id FROM jsonb_to_recordset(p_rows) AS j(id TEXT))) AND m.id = i.id;
END $$;
"""
