"""The PostgreSQL schema of the shared store, created and upgraded at start-up.

``MIGRATIONS[n]`` takes the database from version ``n`` to ``n + 1``; the
version reached is kept in ``kiln_schema``. ``migrate`` runs under an advisory
lock, so when several replicas start at the same moment one applies what is
missing and the others wait for it, then find nothing to do. The next change
of a column is a new entry at the end of the list, never an edit of an old one.

Tables:

* ``usage_events``: the rows of usage accounting (docs/reference.md), the same columns as SQLite's
  (``created_at`` stays ISO-8601 text so that one query serves both stores),
  plus ``rowid`` (insertion order, for the inspector's paging) and
  ``replica`` (which gateway wrote it).
* ``kiln_orgs``: ``spent`` per org, always ``SUM(cost)`` of its rows: the
  same transactions that insert rows add their cost.
* ``kiln_holds``: one row per request in flight (request rule 5 (docs/reference.md)): its slot is
  the row, its credit hold ``amount``; the rest is what its ``replica_lost``
  row needs should its replica die.
* ``kiln_replicas``: each replica's last heartbeat.

The functions keep each of admission, settlement and reaping to one round trip
for a whole batch of requests.

Version 2 (``kilnproxy.store.postgres.migrations.v2``) adds runtime orgs, keys and grants,
and makes ``kiln_admit`` hold keys' limits and check per-minute limits; version 3
(``kilnproxy.store.postgres.migrations.v3``) the ``requested_model`` of fallbacks; version 4
(``kilnproxy.store.postgres.migrations.v4``) settles the per-minute entries in ``kiln_settle`` itself
instead of in triggers; version 5 (``kilnproxy.store.postgres.migrations.v5``) lets a key's
per-minute entries go once out of the window; version 6 (``kilnproxy.store.postgres.migrations.v6``)
has ``kiln_settle`` read only the rows it settles (an index of ``replica_lost`` rows, the holds
and per-minute entries looked up by id); version 7 (``kilnproxy.store.postgres.migrations.v7``) has
``kiln_reap`` skip the holds another transaction has locked, so that a reap and a settlement
never wait for each other; version 8 (``kilnproxy.store.postgres.migrations.v8``) has ``kiln_settle`` and
``kiln_minute_full`` lock per-minute entries in the order of their ids, so that a settlement and an
admission never wait for each other on them; version 9 (``kilnproxy.store.postgres.migrations.v9``) sums a
per-minute window's tokens as a NUMERIC, which a bound near the largest BIGINT no longer overflows;
version 10 (``kilnproxy.store.postgres.migrations.v10``) has ``kiln_reap`` lock the per-minute entries it updates in
the order of their ids as well, so that a reap never waits for an admission or a settlement on them
while holding one they need; version 11 (``kilnproxy.store.postgres.migrations.v11``) adds the
usage row's ``upstream``, which ``kiln_settle`` keeps; version 12
(``kilnproxy.store.postgres.migrations.v12``) the runtime orgs' and keys' ``priority`` and ``weight``;
version 13 (``kilnproxy.store.postgres.migrations.v13``) the Batch API's tables and the usage row's
``batch_id``, which ``kiln_settle`` keeps; version 14
(``kilnproxy.store.postgres.migrations.v14``) a key's ``role``; version 15
(``kilnproxy.store.postgres.migrations.v15``) ``usage_daily``, the spend query's rollup of the rows by
day, org, key and model, kept in step by triggers.
"""

from __future__ import annotations

from ...errors import StorageError
from .migrations.v2 import V2
from .migrations.v3 import V3
from .migrations.v4 import V4
from .migrations.v5 import V5
from .migrations.v6 import V6
from .migrations.v7 import V7
from .migrations.v8 import V8
from .migrations.v9 import V9
from .migrations.v10 import V10
from .migrations.v11 import V11
from .migrations.v12 import V12
from .migrations.v13 import V13
from .migrations.v14 import V14
from .migrations.v15 import V15

MIGRATION_LOCK = 0x6B696C6E  # "kiln": the advisory lock key of schema changes

_V1 = """
CREATE TABLE usage_events (
    id TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    org TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT,
    endpoint TEXT NOT NULL,
    stream INTEGER NOT NULL,
    status INTEGER NOT NULL,
    error_code TEXT,
    prompt_tokens BIGINT NOT NULL DEFAULT 0,
    completion_tokens BIGINT NOT NULL DEFAULT 0,
    cached_tokens BIGINT NOT NULL DEFAULT 0,
    total_tokens BIGINT NOT NULL DEFAULT 0,
    cost DOUBLE PRECISION NOT NULL DEFAULT 0,
    duration_ms DOUBLE PRECISION,
    ttft_ms DOUBLE PRECISION,
    finish_reason TEXT,
    disconnected INTEGER NOT NULL DEFAULT 0,
    rowid BIGINT GENERATED ALWAYS AS IDENTITY,
    replica TEXT
);
CREATE INDEX usage_events_org_created ON usage_events (org, created_at);
CREATE INDEX usage_events_created ON usage_events (created_at);
CREATE INDEX usage_events_model_created ON usage_events (model, created_at);
CREATE INDEX usage_events_errors_created ON usage_events (created_at) WHERE status >= 400;

CREATE TABLE kiln_orgs (
    org TEXT PRIMARY KEY,
    spent DOUBLE PRECISION NOT NULL DEFAULT 0
);

CREATE TABLE kiln_replicas (
    id TEXT PRIMARY KEY,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    seen_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE kiln_holds (
    id TEXT PRIMARY KEY,
    org TEXT NOT NULL,
    replica TEXT NOT NULL,
    amount DOUBLE PRECISION NOT NULL,
    prompt_cost DOUBLE PRECISION NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    created_at TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT,
    endpoint TEXT NOT NULL,
    stream INTEGER NOT NULL,
    held_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX kiln_holds_org ON kiln_holds (org);
CREATE INDEX kiln_holds_replica ON kiln_holds (replica);

-- Step 5 for a batch of requests in one transaction, in their order: for each, count its org's live
-- holds, check the org's credits, place the hold. Admissions of one org queue on an advisory lock
-- (held until commit, taken in one global order), never on the org's row, so they do not wait for a
-- settlement's disk flush. Spending and holds are read in one statement, one snapshot: a settlement
-- committing meanwhile is seen whole (cost in, hold out) or not at all. Holds of a replica silent
-- for p_timeout seconds no longer count. The commit need not wait for the disk: a hold lost in a
-- crash of the database only frees a slot early.
CREATE FUNCTION kiln_admit(p_holds JSONB, p_replica TEXT, p_timeout DOUBLE PRECISION)
RETURNS TABLE (r_id TEXT, r_verdict TEXT, r_spent DOUBLE PRECISION) LANGUAGE plpgsql AS $$
DECLARE
    h RECORD;
    v_count INTEGER;
    v_held DOUBLE PRECISION;
BEGIN
    SET LOCAL synchronous_commit = off;
    PERFORM pg_advisory_xact_lock(1263, k)
       FROM (SELECT DISTINCT hashtext(x.org) AS k FROM jsonb_to_recordset(p_holds) AS x(org TEXT) ORDER BY 1) o;
    FOR h IN SELECT * FROM jsonb_to_recordset(p_holds) AS x(
            id TEXT, org TEXT, "limit" INTEGER, granted DOUBLE PRECISION, amount DOUBLE PRECISION,
            prompt_cost DOUBLE PRECISION, prompt_tokens BIGINT, created_at TEXT, key_id TEXT, model TEXT,
            endpoint TEXT, stream INTEGER) LOOP
        SELECT coalesce((SELECT o.spent FROM kiln_orgs o WHERE o.org = h.org), 0), count(*),
               coalesce(sum(k.amount), 0)
          INTO r_spent, v_count, v_held
          FROM kiln_holds k JOIN kiln_replicas r ON r.id = k.replica
         WHERE k.org = h.org AND r.seen_at > now() - make_interval(secs => p_timeout);
        r_id := h.id;
        IF v_count >= h."limit" THEN
            r_verdict := 'rate_limited';
        ELSIF h.granted - r_spent - v_held <= 0 THEN
            r_verdict := 'insufficient_credits';
        ELSE
            INSERT INTO kiln_holds (id, org, replica, amount, prompt_cost, prompt_tokens, created_at, key_id,
                                    model, endpoint, stream)
            VALUES (h.id, h.org, p_replica, h.amount, h.prompt_cost, h.prompt_tokens, h.created_at, h.key_id,
                    h.model, h.endpoint, h.stream);
            r_verdict := 'ok';
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;

-- Settlement of a batch in one transaction: delete the rows' holds, insert the rows, add their cost
-- to the orgs' spending. Its commit waits for the disk as the database is set to (synchronous_commit,
-- on by default: rows are money). Idempotent by id: a row already there is skipped (a retried batch charges
-- nothing twice), except a replica_lost row, which the real row replaces (charging the difference).
-- The holds go first, in a statement of their own: should a reaper be turning one of them into a
-- replica_lost row right now, this waits for it, and the next statement sees that row and replaces it.
CREATE FUNCTION kiln_settle(p_rows JSONB, p_replica TEXT)
RETURNS TABLE (r_org TEXT, r_spent DOUBLE PRECISION) LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM kiln_holds h USING jsonb_to_recordset(p_rows) AS i(id TEXT) WHERE h.id = i.id;
    RETURN QUERY
    WITH incoming AS (
        SELECT * FROM jsonb_to_recordset(p_rows) AS x(
            id TEXT, created_at TEXT, org TEXT, key_id TEXT, model TEXT, endpoint TEXT, stream INTEGER,
            status INTEGER, error_code TEXT, prompt_tokens BIGINT, completion_tokens BIGINT,
            cached_tokens BIGINT, total_tokens BIGINT, cost DOUBLE PRECISION, duration_ms DOUBLE PRECISION,
            ttft_ms DOUBLE PRECISION, finish_reason TEXT, disconnected INTEGER)
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
            finish_reason = i.finish_reason, disconnected = i.disconnected, replica = p_replica
          FROM incoming i JOIN lost l ON l.id = i.id
         WHERE u.id = i.id
        RETURNING u.org, i.cost - l.cost AS delta
    ), inserted AS (
        INSERT INTO usage_events (id, created_at, org, key_id, model, endpoint, stream, status, error_code,
                                  prompt_tokens, completion_tokens, cached_tokens, total_tokens, cost,
                                  duration_ms, ttft_ms, finish_reason, disconnected, replica)
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

-- The holds of replicas silent for p_timeout seconds (or never seen) become replica_lost rows,
-- charged the prompt part of the hold. A hold a live replica settles meanwhile is not reaped.
-- Replicas silent ten times that long, with no hold left, are forgotten.
CREATE FUNCTION kiln_reap(p_timeout DOUBLE PRECISION)
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
                                  duration_ms, ttft_ms, finish_reason, disconnected, replica)
        SELECT d.id, d.created_at, d.org, d.key_id, d.model, d.endpoint, d.stream, 502, 'replica_lost',
               d.prompt_tokens, 0, 0, d.prompt_tokens, d.prompt_cost,
               round(extract(epoch FROM now() - d.held_at)::numeric * 1000, 3)::DOUBLE PRECISION, NULL, NULL, 1,
               d.replica
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
"""

MIGRATIONS: tuple[str, ...] = (_V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14, V15)


async def migrate(conn) -> int:
    """Bring the schema to the last version; returns the version found before. Safe to call
    from several replicas at once (they queue on the advisory lock)."""
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS kiln_schema (version INTEGER NOT NULL)")
        found = await conn.fetchval("SELECT max(version) FROM kiln_schema") or 0
        if found > len(MIGRATIONS):
            raise StorageError(f"the database's schema is version {found}, newer than this kilnproxy knows "
                               f"({len(MIGRATIONS)}): upgrade kilnproxy")
        for version in range(found, len(MIGRATIONS)):
            async with conn.transaction():
                await conn.execute(MIGRATIONS[version])
                await conn.execute("INSERT INTO kiln_schema (version) VALUES ($1)", version + 1)
        return found
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
