"""Version 7 of the PostgreSQL schema: a reap never waits for a hold a settlement is deleting.

``kiln_reap`` deleted the holds of silent replicas in the order of a
sequential scan of ``kiln_holds`` (where each row happens to lie), waiting for
any a settlement had locked; ``kiln_settle`` deletes the holds of its rows in
the order of their ids. A replica that was only cut off and comes back settles
rows whose holds another replica is reaping at that moment: each transaction
could hold one hold the other waits for, and PostgreSQL's deadlock detector
ended one of them (the reap, logged as a traceback by the heartbeat; or the
settlement, its rows spooled and retried).

Now the reap locks the holds it deletes first, skipping those another
transaction has locked (``FOR UPDATE SKIP LOCKED``): such a hold is being
settled or re-placed by a live replica right now, which is what a reap must
not turn into a ``replica_lost`` row anyway; if that transaction rolls back,
the next reap (a heartbeat later) takes the hold. A reap thus waits for no
hold, and a settlement waits at most for holds a reap has taken (its first
statement, before it holds any other lock), so the two no longer wait for
each other; both take the orgs' rows in the orgs' order, last. Same
signature: replicas of the release before keep working during a rolling
upgrade (they call this function).
"""

V7 = """
-- Version 4's, the holds locked before they are deleted, those locked by another transaction skipped.
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
    ), minutes AS (
        UPDATE kiln_minute m SET tokens = i.total_tokens FROM inserted i WHERE m.id = i.id
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
