"""Version 2 of the PostgreSQL schema: runtime tenancy, keys' limits, per-minute limits.

* Orgs made at runtime, keys (their SHA-256 only), credit grants (unique per
  org and reference: a retried payment credits once), the audit log, and one
  change counter bumped in the transaction of every change (its row lock
  orders changes; the audit event of a change has the counter's new value as
  id). The same tables as the SQLite file's (``kilnproxy.store.tenancy.sql``),
  in the same types where the dialects allow: timestamps as ISO-8601 text,
  booleans as 0/1, JSON as text.
* ``kiln_admit`` also holds a key's ``limit`` like its org's credits (the
  key's rows since its period began plus its live holds; the org's lock covers
  its keys) and checks requests and tokens per minute of the org and the key,
  exact over any 60 s across replicas: each admission under such a bound
  leaves a ``kiln_minute`` entry, in the same transaction as its slot and
  hold; a usage row's insertion settles the entry's tokens to the real count
  (a trigger, so settlement itself is unchanged).
"""

from ...tenancy.sql import TENANCY_TABLES

V2 = TENANCY_TABLES + """
CREATE TABLE kiln_minute (
    id TEXT PRIMARY KEY,
    org TEXT NOT NULL,
    key_id TEXT NOT NULL,
    at TIMESTAMPTZ NOT NULL,
    tokens BIGINT NOT NULL
);
CREATE INDEX kiln_minute_org_at ON kiln_minute (org, at);
CREATE INDEX kiln_minute_key_at ON kiln_minute (key_id, at);

-- Whether an org's (p_key NULL) or a key's admissions of the last 60 s reach a bound; the org's
-- entries older than that are dropped on the way (the org's admission lock is held).
CREATE FUNCTION kiln_minute_full(p_org TEXT, p_key TEXT, p_rpm BIGINT, p_tpm BIGINT) RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
DECLARE
    v_requests BIGINT;
    v_tokens BIGINT;
BEGIN
    IF p_rpm IS NULL AND p_tpm IS NULL THEN
        RETURN FALSE;
    END IF;
    IF p_key IS NULL THEN
        DELETE FROM kiln_minute WHERE org = p_org AND at <= now() - interval '60 seconds';
        SELECT count(*), coalesce(sum(tokens), 0) INTO v_requests, v_tokens
          FROM kiln_minute WHERE org = p_org AND at > now() - interval '60 seconds';
    ELSE
        SELECT count(*), coalesce(sum(tokens), 0) INTO v_requests, v_tokens
          FROM kiln_minute WHERE key_id = p_key AND at > now() - interval '60 seconds';
    END IF;
    RETURN v_requests >= p_rpm OR v_tokens >= p_tpm;
END $$;
CREATE OR REPLACE FUNCTION kiln_admit(p_holds JSONB, p_replica TEXT, p_timeout DOUBLE PRECISION)
RETURNS TABLE (r_id TEXT, r_verdict TEXT, r_spent DOUBLE PRECISION) LANGUAGE plpgsql AS $$
DECLARE
    h RECORD;
    v_count INTEGER;
    v_held DOUBLE PRECISION;
    v_key_used DOUBLE PRECISION;
    v_per_minute BOOLEAN;
BEGIN
    SET LOCAL synchronous_commit = off;
    PERFORM pg_advisory_xact_lock(1263, k)
       FROM (SELECT DISTINCT hashtext(x.org) AS k FROM jsonb_to_recordset(p_holds) AS x(org TEXT) ORDER BY 1) o;
    FOR h IN SELECT * FROM jsonb_to_recordset(p_holds) AS x(
            id TEXT, org TEXT, "limit" INTEGER, granted DOUBLE PRECISION, amount DOUBLE PRECISION,
            prompt_cost DOUBLE PRECISION, prompt_tokens BIGINT, created_at TEXT, key_id TEXT, model TEXT,
            endpoint TEXT, stream INTEGER, key_limit DOUBLE PRECISION, key_since TEXT, tokens BIGINT,
            org_rpm BIGINT, org_tpm BIGINT, key_rpm BIGINT, key_tpm BIGINT) LOOP
        SELECT coalesce((SELECT o.spent FROM kiln_orgs o WHERE o.org = h.org), 0), count(*),
               coalesce(sum(k.amount), 0)
          INTO r_spent, v_count, v_held
          FROM kiln_holds k JOIN kiln_replicas r ON r.id = k.replica
         WHERE k.org = h.org AND r.seen_at > now() - make_interval(secs => p_timeout);
        v_key_used := 0;
        IF h.key_limit IS NOT NULL THEN
            -- one statement, one snapshot: a request settled meanwhile is a row or a hold, never neither
            SELECT coalesce((SELECT sum(u.cost) FROM usage_events u
                              WHERE u.key_id = h.key_id AND u.created_at >= h.key_since), 0)
                 + coalesce((SELECT sum(k.amount) FROM kiln_holds k JOIN kiln_replicas r ON r.id = k.replica
                              WHERE k.key_id = h.key_id AND r.seen_at > now() - make_interval(secs => p_timeout)), 0)
              INTO v_key_used;
        END IF;
        v_per_minute := coalesce(h.org_rpm, h.org_tpm, h.key_rpm, h.key_tpm) IS NOT NULL;
        r_id := h.id;
        IF v_count >= h."limit" THEN
            r_verdict := 'rate_limited';
        ELSIF v_per_minute AND kiln_minute_full(h.org, NULL, h.org_rpm, h.org_tpm) THEN
            r_verdict := 'org_per_minute';
        ELSIF v_per_minute AND kiln_minute_full(h.org, h.key_id, h.key_rpm, h.key_tpm) THEN
            r_verdict := 'key_per_minute';
        ELSIF h.granted - r_spent - v_held <= 0 THEN
            r_verdict := 'insufficient_credits';
        ELSIF h.key_limit IS NOT NULL AND h.key_limit - v_key_used <= 0 THEN
            r_verdict := 'key_limit_exceeded';
        ELSE
            INSERT INTO kiln_holds (id, org, replica, amount, prompt_cost, prompt_tokens, created_at, key_id,
                                    model, endpoint, stream)
            VALUES (h.id, h.org, p_replica, h.amount, h.prompt_cost, h.prompt_tokens, h.created_at, h.key_id,
                    h.model, h.endpoint, h.stream);
            IF v_per_minute THEN
                INSERT INTO kiln_minute (id, org, key_id, at, tokens) VALUES (h.id, h.org, h.key_id, now(), h.tokens);
            END IF;
            r_verdict := 'ok';
        END IF;
        RETURN NEXT;
    END LOOP;
END $$;
CREATE FUNCTION kiln_minute_settle() RETURNS TRIGGER LANGUAGE plpgsql AS $$
BEGIN
    UPDATE kiln_minute m SET tokens = r.total_tokens FROM settled r WHERE m.id = r.id;
    RETURN NULL;
END $$;
CREATE TRIGGER kiln_minute_inserted AFTER INSERT ON usage_events
    REFERENCING NEW TABLE AS settled FOR EACH STATEMENT EXECUTE FUNCTION kiln_minute_settle();
CREATE TRIGGER kiln_minute_updated AFTER UPDATE ON usage_events
    REFERENCING NEW TABLE AS settled FOR EACH STATEMENT EXECUTE FUNCTION kiln_minute_settle();
"""
