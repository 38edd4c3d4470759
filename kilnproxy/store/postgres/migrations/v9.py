"""Version 9 of the PostgreSQL schema: a per-minute window's tokens are summed as a NUMERIC.

``kiln_minute_full`` read the sum of a window's tokens into a BIGINT. Each
entry fits one (a hold's tokens are at most 2**53 - 1, a row's count at most
twice that), but their sum over a minute may not, under a
``tokens_per_minute`` near the largest a BIGINT holds: PostgreSQL then
refused the statement, and every admission of that org or key was a 503
until the entries left the window. The sum is now compared as the NUMERIC
``sum`` gives. Same signature: replicas of the release before keep working
during a rolling upgrade (they call this function).
"""

V9 = """
-- Version 8's, with v_tokens a NUMERIC.
CREATE OR REPLACE FUNCTION kiln_minute_full(p_org TEXT, p_key TEXT, p_rpm BIGINT, p_tpm BIGINT) RETURNS BOOLEAN
LANGUAGE plpgsql AS $$
DECLARE
    v_requests BIGINT;
    v_tokens NUMERIC;
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
"""
