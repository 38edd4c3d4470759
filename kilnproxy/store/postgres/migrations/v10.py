"""Version 10 of the PostgreSQL schema: a reap takes per-minute entries in the order of their ids too.

``kiln_reap`` updates the per-minute entries of the holds it turns into
``replica_lost`` rows (their tokens, ``kilnproxy.store.postgres.migrations.v4``) in the
order its join returns them (where the holds lie in the table); an admission
that checks a per-minute bound (``kiln_minute_full``) drops the org's (or the
key's) entries older than 60 s, and a settlement updates its rows' entries,
both in the order of their ids since version 8 (``kilnproxy.store.postgres.migrations.v8``).
A silent replica's holds are mostly older than 60 s: a reap of two of them,
placed in the opposite order of their ids, while a request of their org was
admitted, could each hold one entry the other waited for, and PostgreSQL's
deadlock detector ended one transaction (the reap, a warning and another try
at the next heartbeat; or the admission, its requests answered 503).

Now the reap locks the entries it will update first, in the order of their ids
(``ORDER BY id FOR UPDATE``), as the other two do. It still takes them last,
after the orgs' rows, as a settlement does; the holds are still locked with
``SKIP LOCKED`` (``kilnproxy.store.postgres.migrations.v7``). Same signature: replicas of
the release before keep working during a rolling upgrade (they call this
function).
"""

V10 = """
-- Version 7's, the per-minute entries locked in the order of their ids before they are updated.
CREATE OR REPLACE FUNCTION kiln_reap(p_timeout DOUBLE PRECISION)
RETURNS TABLE (org TEXT, spent DOUBLE PRECISION, lost BIGINT) LANGUAGE sql AS $$
    WITH forgotten AS (
        DELETE FROM kiln_replicas r
         WHERE r.seen_at < now() - make_interval(secs => 10 * p_timeout)
           AND NOT EXISTS (SELECT 1 FROM kiln_holds h WHERE h.replica = r.id)
    ), doomed AS MATERIALIZED (
        SELECT h.id FROM kiln_holds h
         WHERE NOT EXISTS (SELECT 1 FROM kiln_replicas r
                            WHERE r.id = h.replica AND r.seen_at > now() - make_interval(secs => p_timeout))
           FOR UPDATE OF h SKIP LOCKED
    ), dead AS (
        DELETE FROM kiln_holds h USING doomed d WHERE h.id = d.id
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
        RETURNING usage_events.id, usage_events.org, usage_events.cost, usage_events.total_tokens
    ), entries AS MATERIALIZED (
        -- read only by ``minutes``, which the main query does not read: run after it, the orgs' rows
        -- taken first; the sort hands each entry over only once those of smaller ids are locked
        SELECT m.id FROM kiln_minute m WHERE m.id IN (SELECT i.id FROM inserted i) ORDER BY m.id FOR UPDATE OF m
    ), minutes AS (
        UPDATE kiln_minute m SET tokens = i.total_tokens FROM entries e JOIN inserted i ON i.id = e.id
         WHERE m.id = e.id
    ), deltas AS (
        SELECT i.org, sum(i.cost) AS delta, count(*) AS lost FROM inserted i GROUP BY i.org ORDER BY i.org
    ), charged AS (
        INSERT INTO kiln_orgs AS o (org, spent) SELECT d.org, d.delta FROM deltas d
        ON CONFLICT (org) DO UPDATE SET spent = o.spent + EXCLUDED.spent
        RETURNING o.org, o.spent
    )
    SELECT c.org, c.spent, d.lost FROM charged c JOIN deltas d ON d.org = c.org;
$$;
"""
