-- The oversell proof, same rule and output as in 20261129000004_audit_maintenance.sql, with each
-- grant's limit looked up through credential_events_configuration_idx instead of a range join
-- against every limit period: the planner cannot estimate the lifetimes a set-returning function
-- yields, and for a busy range it chose a nested loop over (grants x limit periods) that took
-- 10.7 s for 25,000 grants on 1,000 credentials. With the lookup the cost is one index probe per
-- grant.
CREATE OR REPLACE FUNCTION credpool_oversell_check(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (
    key_id text, max_concurrent_uses integer, leases bigint, peak bigint, grants_over_limit bigint,
    first_violation_at timestamptz)
LANGUAGE sql STABLE AS $$
    WITH lives AS (
        SELECT * FROM credpool_lease_lifetimes(p_since, p_until)
    ),
    edges AS (
        SELECT l.key_id, l.granted_at AS at, 1 AS delta FROM lives l
        UNION ALL
        SELECT l.key_id, coalesce(l.ended_at, 'infinity'::timestamptz), -1 FROM lives l
    ),
    running AS (
        SELECT e.key_id, e.at, e.delta,
               sum(e.delta) OVER (PARTITION BY e.key_id ORDER BY e.at, e.delta
                                  ROWS UNBOUNDED PRECEDING) AS held
        FROM edges e
    ),
    grants AS (
        SELECT r.key_id, r.at, r.held,
               coalesce(
                   (SELECT (ce.details -> 'new' ->> 'max_concurrent_uses')::integer
                    FROM credential_events ce
                    WHERE ce.key_id = r.key_id
                      AND ce.event IN ('created', 'updated')
                      AND ce.at <= r.at
                    ORDER BY ce.at DESC
                    LIMIT 1),
                   (SELECT c.max_concurrent_uses FROM credentials c WHERE c.key_id = r.key_id)
               ) AS limit_then
        FROM running r
        WHERE r.delta = 1 AND r.at >= p_since AND r.at < p_until
    )
    SELECT g.key_id,
           (SELECT c.max_concurrent_uses FROM credentials c WHERE c.key_id = g.key_id),
           count(*),
           max(g.held),
           count(*) FILTER (WHERE g.held > g.limit_then),
           min(g.at) FILTER (WHERE g.held > g.limit_then)
    FROM grants g
    GROUP BY g.key_id
    ORDER BY g.key_id
$$;

-- Group claiming (src/groups.rs) runs many claim statements in one transaction, in whatever order
-- requests arrive. That is deadlock-free only if a claim never waits for a row lock: it takes its
-- slot row with SKIP LOCKED, so the one row lock it may not wait for is the credential row it
-- used to update for `last_used_at`. The time of a credential's latest grant now lives on the
-- slot that granted it (`last_granted_at`, kept when the lease ends), and a credential's
-- last_used_at is the latest of its slots'. A claim updates its slot row and nothing else.
ALTER TABLE lease_slots ADD COLUMN last_granted_at timestamptz;

UPDATE lease_slots s
SET last_granted_at = c.last_used_at
FROM credentials c
WHERE c.key_id = s.key_id AND s.slot = 0 AND c.last_used_at IS NOT NULL;

ALTER TABLE credentials DROP COLUMN last_used_at;
