"""Version 8 of the PostgreSQL schema: a settlement and an admission take per-minute entries in one order.

``kiln_settle`` updates the per-minute entries of the rows it settles (their
tokens, ``kilnproxy.store.postgres.migrations.v4``); an admission that checks a per-minute
bound (``kiln_minute_full``) first deletes the org's (or the key's) entries older
than 60 s. The settlement took its entries in the order of their ids (the
primary key), the admission in the order of their time (the ``(org, at)`` or
``(key_id, at)`` index, or where they lie in the table): two requests of one org
longer than 60 s, settled in one batch while another request of that org was
admitted, could each hold one entry the other waited for, and PostgreSQL's
deadlock detector ended one transaction (the settlement's rows spooled and
retried, or the admitted requests answered 503).

Now both lock the entries first, in the order of their ids (``ORDER BY id FOR
UPDATE``: the rows are locked as the sort returns them), so neither waits for an
entry while holding one the other needs. Same signatures: replicas of the release
before keep working during a rolling upgrade (they call these functions).
"""

V8 = """
-- Version 5's, the entries to drop locked in the order of their ids before they are deleted.
CREATE OR REPLACE FUNCTION kiln_minute_full(p_org TEXT, p_key TEXT, p_rpm BIGINT, p_tpm BIGINT) RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
DECLARE
    v_requests BIGINT;
    v_tokens BIGINT;
BEGIN
    IF p_rpm IS NULL AND p_tpm IS NULL THEN
        RETURN FALSE;
    END IF;
    IF p_key IS NULL THEN
        DELETE FROM kiln_minute WHERE id IN (SELECT o.id FROM kiln_minute o
                                              WHERE o.org = p_org AND o.at <= now() - interval '60 seconds'
                                              ORDER BY o.id FOR UPDATE);
        SELECT count(*), coalesce(sum(tokens), 0) INTO v_requests, v_tokens
          FROM kiln_minute WHERE org = p_org AND at > now() - interval '60 seconds';
    ELSE
        DELETE FROM kiln_minute WHERE id IN (SELECT o.id FROM kiln_minute o
                                              WHERE o.key_id = p_key AND o.at <= now() - interval '60 seconds'
                                              ORDER BY o.id FOR UPDATE);
        SELECT count(*), coalesce(sum(tokens), 0) INTO v_requests, v_tokens
          FROM kiln_minute WHERE key_id = p_key AND at > now() - interval '60 seconds';
    END IF;
    RETURN v_requests >= p_rpm OR v_tokens >= p_tpm;
END $$;

-- Version 6's, the per-minute entries locked in the order of their ids before they are updated.
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
    -- the entries locked in the order of their ids, as an admission takes those it drops (kiln_minute_full)
    PERFORM 1 FROM kiln_minute m
      WHERE m.id = ANY (ARRAY(SELECT j.id FROM jsonb_to_recordset(p_rows) AS j(id TEXT)))
      ORDER BY m.id FOR UPDATE;
    UPDATE kiln_minute m SET tokens = i.total_tokens
      FROM jsonb_to_recordset(p_rows) AS i(id TEXT, total_tokens BIGINT)
     WHERE m.id = ANY (ARRAY(SELECT j.id FROM jsonb_to_recordset(p_rows) AS j(id TEXT))) AND m.id = i.id;
END $$;
"""
