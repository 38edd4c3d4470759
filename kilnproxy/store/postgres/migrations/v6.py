"""Version 6 of the PostgreSQL schema: a settlement reads only the rows it settles.

Three statements of ``kiln_settle`` joined the incoming batch
(``jsonb_to_recordset``, which PostgreSQL plans for 100 rows whatever its
size) to a table by id, and were planned as a hash join against a
sequential scan of that table, read whole at every settlement, so that a
settlement's time grew with the tables:

* the search for ``replica_lost`` rows to replace among the incoming ids: no
  index led to them, so all of ``usage_events`` was read (one row settled,
  fsync off: 0.24 ms at 200 rows, 0.47 ms at 5,000, 2.9 ms at 20,000). A
  partial index of those rows only (rare: a replica died with requests in
  flight) makes it a look into a nearly empty index.
* the holds' deletion and the per-minute entries' update read all of
  ``kiln_holds`` (every request in flight on every replica) and
  ``kiln_minute`` (every admission of the last minute under a per-minute
  limit; 2.1 ms a settlement at 30,000 entries): both now look the batch's
  ids up in the tables' primary keys (``= ANY`` of the ids as an array).

The index is built in the migration's transaction (one pass over the table,
during which settlements wait for it, as they wait for any lock, up to
``lock_timeout``, then spool their rows). Same signatures: replicas of the
release before keep working during a rolling upgrade (with the index, and
the new ``kiln_settle``).
"""

V6 = """
CREATE INDEX usage_events_replica_lost ON usage_events (id) WHERE error_code = 'replica_lost';

-- Version 4's, the holds deleted and the per-minute entries updated by their primary keys.
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
               x.ttft_ms, x.finish_reason, x.disconnected, coalesce(x.requested_model, x.model) AS requested_model
          FROM jsonb_to_recordset(p_rows) AS x(
            id TEXT, created_at TEXT, org TEXT, key_id TEXT, model TEXT, endpoint TEXT, stream INTEGER,
            status INTEGER, error_code TEXT, prompt_tokens BIGINT, completion_tokens BIGINT,
            cached_tokens BIGINT, total_tokens BIGINT, cost DOUBLE PRECISION, duration_ms DOUBLE PRECISION,
            ttft_ms DOUBLE PRECISION, finish_reason TEXT, disconnected INTEGER, requested_model TEXT)
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
            replica = p_replica
          FROM incoming i JOIN lost l ON l.id = i.id
         WHERE u.id = i.id
        RETURNING u.org, i.cost - l.cost AS delta
    ), inserted AS (
        INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status, error_code,
                                  prompt_tokens, completion_tokens, cached_tokens, total_tokens, cost,
                                  duration_ms, ttft_ms, finish_reason, disconnected, requested_model, replica)
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
    UPDATE kiln_minute m SET tokens = i.total_tokens
      FROM jsonb_to_recordset(p_rows) AS i(id TEXT, total_tokens BIGINT)
     WHERE m.id = ANY (ARRAY(SELECT j.id FROM jsonb_to_recordset(p_rows) AS j(id TEXT))) AND m.id = i.id;
END $$;
"""
