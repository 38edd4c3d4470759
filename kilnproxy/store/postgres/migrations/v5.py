"""Version 5 of the PostgreSQL schema: a key's per-minute entries are let go once out of the window.

``kiln_minute_full`` dropped the entries older than 60 s only when it checked
an org's bound. A key with a ``requests_per_minute`` or ``tokens_per_minute``
whose org has none left one entry per admission in ``kiln_minute`` for ever
(the counts stayed right: they read the last 60 s only). Now checking a key's
bound drops that key's old entries too, on the ``(key_id, at)`` index, under
the org's admission lock as before. Same signature: replicas of the release
before keep working during a rolling upgrade.
"""

V5 = """
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
        DELETE FROM kiln_minute WHERE org = p_org AND at <= now() - interval '60 seconds';
        SELECT count(*), coalesce(sum(tokens), 0) INTO v_requests, v_tokens
          FROM kiln_minute WHERE org = p_org AND at > now() - interval '60 seconds';
    ELSE
        DELETE FROM kiln_minute WHERE key_id = p_key AND at <= now() - interval '60 seconds';
        SELECT count(*), coalesce(sum(tokens), 0) INTO v_requests, v_tokens
          FROM kiln_minute WHERE key_id = p_key AND at > now() - interval '60 seconds';
    END IF;
    RETURN v_requests >= p_rpm OR v_tokens >= p_tpm;
END $$;
"""
