"""Version 3 of the PostgreSQL schema: fallbacks across models.

A row's ``requested_model`` (the catalog id asked for; rows from before are
filled with their ``model``, which served them); a hold's ``requested_model``
once a fallback has re-placed it (``kiln_rehold``), so that a ``replica_lost``
row names both; rows settled without the field (an older spool or ledger) take
their ``model``.
"""

V3 = """
ALTER TABLE usage_events ADD COLUMN requested_model TEXT;
-- (the fill is no settlement: the per-minute trigger of version 2 has nothing to do)
ALTER TABLE usage_events DISABLE TRIGGER kiln_minute_updated;
UPDATE usage_events SET requested_model = model;
ALTER TABLE usage_events ENABLE TRIGGER kiln_minute_updated;
ALTER TABLE kiln_holds ADD COLUMN requested_model TEXT;

CREATE OR REPLACE FUNCTION kiln_settle(p_rows JSONB, p_replica TEXT)
RETURNS TABLE (r_org TEXT, r_spent DOUBLE PRECISION) LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM kiln_holds h USING jsonb_to_recordset(p_rows) AS i(id TEXT) WHERE h.id = i.id;
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
END $$;

CREATE OR REPLACE FUNCTION kiln_reap(p_timeout DOUBLE PRECISION)
RETURNS TABLE (org TEXT, spent DOUBLE PRECISION, lost BIGINT) LANGUAGE sql AS $$
    WITH forgotten AS (
        DELETE FROM kiln_replicas r
         WHERE r.seen_at < now() - make_interval(secs => 10 * p_timeout)
           AND NOT EXISTS (SELECT 1 FROM kiln_holds h WHERE h.replica = r.id)
    ), dead AS (
        DELETE FROM kiln_holds h
         WHERE NOT EXISTS (SELECT 1 FROM kiln_replicas r
                            WHERE r.id = h.replica AND r.seen_at > now() - make_interval(secs => p_timeout))
        RETURNING h.*
    ), inserted AS (
        INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status, error_code,
                                  prompt_tokens, completion_tokens, cached_tokens, total_tokens, cost,
                                  duration_ms, ttft_ms, finish_reason, disconnected, requested_model, replica)
        SELECT d.id, d.created_at, d.org, d.key_id, d.model, d.endpoint, d.stream, 502, 'replica_lost',
               d.prompt_tokens, 0, 0, d.prompt_tokens, d.prompt_cost,
               round(extract(epoch FROM now() - d.held_at)::numeric * 1000, 3)::DOUBLE PRECISION, NULL, NULL, 1,
               coalesce(d.requested_model, d.model), d.replica
          FROM dead d
        ON CONFLICT (id) DO NOTHING
        RETURNING usage_events.org, usage_events.cost
    ), deltas AS (
        SELECT i.org, sum(i.cost) AS delta, count(*) AS lost FROM inserted i GROUP BY i.org ORDER BY i.org
    ), charged AS (
        INSERT INTO kiln_orgs AS o (org, spent) SELECT d.org, d.delta FROM deltas d
        ON CONFLICT (org) DO UPDATE SET spent = o.spent + EXCLUDED.spent
        RETURNING o.org, o.spent
    )
    SELECT c.org, c.spent, d.lost FROM charged c JOIN deltas d ON d.org = c.org;
$$;

-- A fallback re-places a request's hold at its own prices, keeping its slot: checked under the org's
-- admission lock as kiln_admit checks a new hold (the org's credits minus its other live holds; the
-- key's limit minus its rows in the period and its other live holds). 'gone': no such hold (reaped).
CREATE FUNCTION kiln_rehold(p_hold JSONB, p_timeout DOUBLE PRECISION)
RETURNS TABLE (r_verdict TEXT, r_spent DOUBLE PRECISION) LANGUAGE plpgsql AS $$
DECLARE
    h RECORD;
    v_held DOUBLE PRECISION;
    v_key_used DOUBLE PRECISION;
BEGIN
    SET LOCAL synchronous_commit = off;
    SELECT * INTO h FROM jsonb_to_record(p_hold) AS x(
        id TEXT, org TEXT, granted DOUBLE PRECISION, amount DOUBLE PRECISION, prompt_cost DOUBLE PRECISION,
        prompt_tokens BIGINT, key_id TEXT, model TEXT, requested_model TEXT, key_limit DOUBLE PRECISION,
        key_since TEXT);
    PERFORM pg_advisory_xact_lock(1263, hashtext(h.org));
    SELECT coalesce((SELECT o.spent FROM kiln_orgs o WHERE o.org = h.org), 0), coalesce(sum(k.amount), 0)
      INTO r_spent, v_held
      FROM kiln_holds k JOIN kiln_replicas r ON r.id = k.replica
     WHERE k.org = h.org AND k.id <> h.id AND r.seen_at > now() - make_interval(secs => p_timeout);
    IF NOT EXISTS (SELECT 1 FROM kiln_holds WHERE id = h.id) THEN
        r_verdict := 'gone';
    ELSIF h.granted - r_spent - v_held <= 0 THEN
        r_verdict := 'insufficient_credits';
    ELSE
        r_verdict := 'ok';
        IF h.key_limit IS NOT NULL THEN
            -- one statement, one snapshot: a request settled meanwhile is a row or a hold, never neither
            SELECT coalesce((SELECT sum(u.cost) FROM usage_events u
                              WHERE u.key_id = h.key_id AND u.created_at >= h.key_since), 0)
                 + coalesce((SELECT sum(k.amount) FROM kiln_holds k JOIN kiln_replicas r ON r.id = k.replica
                              WHERE k.key_id = h.key_id AND k.id <> h.id
                                AND r.seen_at > now() - make_interval(secs => p_timeout)), 0)
              INTO v_key_used;
            IF h.key_limit - v_key_used <= 0 THEN
                r_verdict := 'key_limit_exceeded';
            END IF;
        END IF;
    END IF;
    IF r_verdict = 'ok' THEN
        UPDATE kiln_holds SET amount = h.amount, prompt_cost = h.prompt_cost, prompt_tokens = h.prompt_tokens,
                              model = h.model, requested_model = coalesce(requested_model, h.requested_model)
         WHERE id = h.id;
    END IF;
    RETURN NEXT;
END $$;
"""
