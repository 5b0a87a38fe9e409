-- The audit trail: append-only, and what is read from it (lease lifetimes, the oversell, window
-- and tenant proofs, utilization), and the proofs' checkpoints (audit_checkpoints: each run proves
-- only what the trail gained since). The trail tables are `lease_events`, `credential_events` and
-- `tenant_events`; rows are inserted in the same statement or transaction as the state change they
-- record, never edited, and removed only by retention (sql/maintenance.sql; it keeps
-- tenant_events).
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one transaction;
-- every statement here must be safe to run again.

-- The trails are append-only: rows are inserted, and later removed only by retention; never edited.
CREATE OR REPLACE FUNCTION lease_events_forbid_update() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

DROP TRIGGER IF EXISTS lease_events_append_only ON lease_events;
CREATE TRIGGER lease_events_append_only
    BEFORE UPDATE ON lease_events
    FOR EACH ROW EXECUTE FUNCTION lease_events_forbid_update();

DROP TRIGGER IF EXISTS credential_events_append_only ON credential_events;
CREATE TRIGGER credential_events_append_only
    BEFORE UPDATE ON credential_events
    FOR EACH ROW EXECUTE FUNCTION lease_events_forbid_update();

-- Leases in flight now: per credential, with holder and time left.
CREATE OR REPLACE VIEW active_leases AS
SELECT s.key_id, s.provider, s.pool, s.slot,
       replace(s.lease_id::text, '-', '') AS lease_id,
       s.holder, s.granted_at, s.lease_until,
       round(extract(epoch FROM s.lease_until - now()), 1) AS seconds_left,
       s.probe
FROM lease_slots s
WHERE s.lease_id IS NOT NULL AND s.lease_until > now();

-- One row per lease whose life overlaps [p_since, p_until), rebuilt from the trail alone: when
-- it was granted and how it ended (`released`, `force_released`, `expired`, or NULL while still
-- held), the outcome, the renewals and how long it was held. A lease's end is its release, or
-- else the last lease_until it was granted or renewed to. Leases granted up to a day before
-- p_since are considered (a lease held longer than a day through renewals is missed by a window
-- that starts after its first day). With p_key_id, one credential (index lease_events_key_id_at_idx).
CREATE OR REPLACE FUNCTION credpool_lease_lifetimes(p_since timestamptz, p_until timestamptz, p_key_id text DEFAULT NULL)
RETURNS TABLE (
    lease_id text, key_id text, provider text, pool text, slot integer, holder text,
    granted_at timestamptz, ended_at timestamptz, ended_by text, outcome text, renewals bigint,
    held_seconds numeric)
LANGUAGE sql STABLE AS $$
    -- One pass over the trail since a day before p_since, grouped by lease, keeping the leases
    -- whose grant is in the range: no join of the trail with itself, so the plan cannot turn
    -- quadratic when the planner's statistics are stale (a trail that grew by a burst since its
    -- last ANALYZE: a nested loop over the grants took 169 s for 60,000 leases). A lease's events
    -- all come at or after its grant, so the time bound loses none of a kept lease's events.
    WITH lives AS (
        SELECT e.lease_id,
               min(e.key_id) AS key_id, min(e.provider) AS provider, min(e.pool) AS pool,
               min(e.slot) AS slot, min(e.holder) AS holder,
               min(e.at) FILTER (WHERE e.event = 'granted') AS granted_at,
               min(e.at) FILTER (WHERE e.event IN ('released', 'force_released')) AS released_at,
               min(e.event) FILTER (WHERE e.event IN ('released', 'force_released')) AS released_by,
               max(e.lease_until) FILTER (WHERE e.event IN ('granted', 'renewed')) AS last_until,
               min(e.outcome) FILTER (WHERE e.outcome IS NOT NULL) AS outcome,
               count(*) FILTER (WHERE e.event = 'renewed') AS renewals
        FROM lease_events e
        WHERE e.at >= p_since - interval '1 day'
          AND (p_key_id IS NULL OR e.key_id = p_key_id)
        GROUP BY e.lease_id
        HAVING min(e.at) FILTER (WHERE e.event = 'granted') < p_until
    )
    SELECT replace(l.lease_id::text, '-', ''), l.key_id, l.provider, l.pool, l.slot, l.holder,
           l.granted_at,
           CASE WHEN l.released_at IS NOT NULL THEN l.released_at
                WHEN l.last_until <= now() THEN l.last_until END,
           CASE WHEN l.released_at IS NOT NULL THEN l.released_by
                WHEN l.last_until <= now() THEN 'expired' END,
           l.outcome, l.renewals,
           round(extract(epoch FROM least(coalesce(l.released_at, l.last_until), now()) - l.granted_at), 3)
    FROM lives l
    WHERE l.granted_at < p_until
      AND coalesce(l.released_at, l.last_until) > p_since
$$;

-- The concurrency proofs' one rule, for either scope: 'credential' (each credential's leases
-- against its limit: the oversell proof) or 'tenant' (each tenant's leases over all its
-- credentials against its cap; leases without a tenant, from before tenants, are not counted).
-- Lowering a limit under load revokes nothing, so more leases than a lowered limit may be held
-- for a while; what may never happen is a GRANT that leaves more leases held than the limit then.
--
-- Reads the trail rows in [p_from, p_until) and takes the leases live at p_from as `p_live` (a
-- checkpoint's, or none when p_from is a lookback before the range judged). Returns every lease
-- among them: its subject, grant, last lease_until before p_until and release; and for each lease
-- granted at or after greatest(p_from, p_judge_from), `held` (its subject's leases held with this
-- grant) and `allowed` (the limit or cap in force then, NULL for none): the grant breaks the rule
-- when held > allowed. A lease lives from its `granted` row to its release (or forced release),
-- else to the last lease_until it was granted or renewed to; at equal times an end sorts before a
-- start, so a slot handed straight from one lease to the next does not count twice. The limit in
-- force is what the subject's latest `created` / `updated` row at or before the grant set
-- (credential_events' `new`, tenant_events' columns; a tenant's NULL cap: none), else the current
-- one (rows are dated when the change took effect); a credential deleted without such a row has
-- none, and its grants are not judged.
--
-- The trail rows come from `p_trail` and the credentials' current limits from `p_credentials`:
-- lease_events and credentials themselves, or their copies on a Citus coordinator
-- (credpool_audit_sources), with the columns the proof reads.
--
-- Chunks compose exactly: a lease is live at p_until when it has no release before it and its
-- lease_until is later (the leases the next chunk must count), and a lease not live at a moment is
-- never live again, since the service refuses to renew or release a lease whose lease_until has
-- passed. One pass over the rows grouped by lease, then one window pass per subject in time
-- order that counts the leases held and carries the limit forward from configuration rows merged
-- into the same order (a look-up per grant cost 7 us, half the proof): no join of the trail with
-- itself, and index credential_events_configuration_idx (tenant_events_tenant_at_idx) read once
-- per subject.
DROP FUNCTION IF EXISTS credpool_scope_lease_check(text, timestamptz, timestamptz,
    audit_live_lease[], timestamptz);
CREATE OR REPLACE FUNCTION credpool_scope_lease_check(p_scope text, p_from timestamptz,
    p_until timestamptz, p_live audit_live_lease[], p_judge_from timestamptz,
    p_trail regclass DEFAULT 'lease_events', p_credentials regclass DEFAULT 'credentials')
RETURNS TABLE (lease_id uuid, subject text, granted_at timestamptz, lease_until timestamptz,
               released_at timestamptz, held bigint, allowed integer)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY EXECUTE format($q$
        WITH lives AS (
            SELECT e.lease_id,
                   min(e.subject) FILTER (WHERE e.event = 'granted') AS subject,
                   min(e.at) FILTER (WHERE e.event = 'granted') AS granted_at,
                   min(e.at) FILTER (WHERE e.event IN ('released', 'force_released')) AS released_at,
                   max(e.lease_until) FILTER (WHERE e.event IN ('granted', 'renewed')) AS lease_until
            FROM (SELECT le.lease_id, le.event, le.at, le.lease_until,
                         CASE $1 WHEN 'credential' THEN le.key_id ELSE le.tenant END AS subject
                  FROM %1$s le
                  WHERE le.at >= $2 AND le.at < $3
                  UNION ALL
                  SELECT l.lease_id, 'granted', l.granted_at, l.lease_until, l.subject
                  FROM unnest($4) l) e
            GROUP BY e.lease_id
            -- a lease ended before the range whose late rows (a report after expiry) are in it
            HAVING min(e.subject) FILTER (WHERE e.event = 'granted') IS NOT NULL
        ),
        -- each subject's configuration rows: its current limit (at -infinity: in force where no row
        -- is), the latest row at or before the first grant judged, and every later one before
        -- the range's end, with what they allowed (NULL: no cap, or a credential deleted)
        configs AS (
            SELECT s.subject, c.at, c.event_id, c.allowed
            FROM (SELECT DISTINCT l.subject FROM lives l) s
            CROSS JOIN LATERAL (
                SELECT '-infinity'::timestamptz AS at, 0::bigint AS event_id,
                       CASE $1
                           -- before its oldest configuration row kept (retention purges older
                           -- ones): what that row changed, else its current limit
                           WHEN 'credential' THEN coalesce(
                               (SELECT (ce.details -> 'old' ->> 'max_concurrent_uses')::integer
                                FROM credential_events ce
                                WHERE ce.key_id = s.subject AND ce.event IN ('created', 'updated')
                                ORDER BY ce.at, ce.event_id
                                LIMIT 1),
                               (SELECT c.max_concurrent_uses FROM %2$s c
                                WHERE c.key_id = s.subject))
                           ELSE (SELECT t.max_concurrent_leases FROM tenants t
                                 WHERE t.tenant_id = s.subject) END AS allowed
                UNION ALL
                (SELECT ce.at, ce.event_id, (ce.details -> 'new' ->> 'max_concurrent_uses')::integer
                 FROM credential_events ce
                 WHERE $1 = 'credential' AND ce.key_id = s.subject
                   AND ce.event IN ('created', 'updated') AND ce.at <= greatest($2, $5)
                 ORDER BY ce.at DESC, ce.event_id DESC
                 LIMIT 1)
                UNION ALL
                SELECT ce.at, ce.event_id, (ce.details -> 'new' ->> 'max_concurrent_uses')::integer
                FROM credential_events ce
                WHERE $1 = 'credential' AND ce.key_id = s.subject
                  AND ce.event IN ('created', 'updated')
                  AND ce.at > greatest($2, $5) AND ce.at < $3
                UNION ALL
                (SELECT te.at, te.event_id, te.max_concurrent_leases
                 FROM tenant_events te
                 WHERE $1 = 'tenant' AND te.tenant_id = s.subject
                   AND te.event IN ('created', 'updated') AND te.at <= greatest($2, $5)
                 ORDER BY te.at DESC, te.event_id DESC
                 LIMIT 1)
                UNION ALL
                SELECT te.at, te.event_id, te.max_concurrent_leases
                FROM tenant_events te
                WHERE $1 = 'tenant' AND te.tenant_id = s.subject
                  AND te.event IN ('created', 'updated')
                  AND te.at > greatest($2, $5) AND te.at < $3) c
        ),
        edges AS (
            SELECT l.lease_id, l.subject, l.granted_at AS at, 1 AS delta, l.lease_until,
                   l.released_at, NULL::bigint AS setting
            FROM lives l
            UNION ALL
            SELECT NULL, l.subject, coalesce(l.released_at, l.lease_until), -1, NULL, NULL, NULL
            FROM lives l
            UNION ALL
            -- a configuration sorts after the ends and before the grants of its instant; `setting`
            -- grows with the rows' order, so a running max is the latest row's: its rank in the high
            -- bits, what it allowed + 1 (0: no cap) in the low 32
            SELECT NULL, c.subject, c.at, 0, NULL, NULL,
                   (row_number() OVER (PARTITION BY c.subject ORDER BY c.at, c.event_id)) * 4294967296
                   + coalesce(c.allowed + 1, 0)
            FROM configs c
        ),
        running AS (
            SELECT e.*,
                   sum(e.delta) OVER w AS held,
                   max(e.setting) OVER w AS latest
            FROM edges e
            WINDOW w AS (PARTITION BY e.subject ORDER BY e.at, e.delta ROWS UNBOUNDED PRECEDING)
        )
        SELECT r.lease_id, r.subject, r.at, r.lease_until, r.released_at,
               CASE WHEN r.at >= greatest($2, $5) THEN r.held END,
               CASE WHEN r.at >= greatest($2, $5)
                    THEN nullif(r.latest %% 4294967296, 0)::integer - 1 END
        FROM running r
        WHERE r.delta = 1
    $q$, p_trail, p_credentials)
    USING p_scope, p_from, p_until, p_live, p_judge_from;
END;
$$;

-- The oversell proof, from the trail alone: for every credential with leases granted in
-- [p_since, p_until), how many, the most leases held at one moment, and every grant that took a
-- credential beyond its limit at that moment (`grants_over_limit`; the rule:
-- credpool_scope_lease_check, scope 'credential'). The leases live at p_since are read from the
-- day before it (a lease renewed for longer than a day is missed); the checkpoints of
-- credpool_audit_advance carry them instead.
-- (VOLATILE, as the other one-shot proofs: on Citus credpool_audit_sources copies the range's
-- rows to the coordinator first.)
CREATE OR REPLACE FUNCTION credpool_oversell_check(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (
    key_id text, max_concurrent_uses integer, leases bigint, peak bigint, grants_over_limit bigint,
    first_violation_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_sources record;
BEGIN
    SELECT * INTO v_sources FROM credpool_audit_sources(p_since - interval '1 day', p_until);
    RETURN QUERY EXECUTE format($q$
        SELECT j.subject,
               (SELECT c.max_concurrent_uses FROM %2$s c WHERE c.key_id = j.subject),
               count(*),
               max(j.held),
               count(*) FILTER (WHERE j.held > j.allowed),
               min(j.granted_at) FILTER (WHERE j.held > j.allowed)
        FROM credpool_scope_lease_check('credential', $1 - interval '1 day', $2, '{}', $1,
                                        %1$L, %2$L) j
        WHERE j.held IS NOT NULL
        GROUP BY j.subject
        ORDER BY j.subject
    $q$, v_sources.trail, v_sources.credentials)
    USING p_since, p_until;
END;
$$;

-- Utilization per credential and hour, for every credential that exists now: lease-seconds held
-- / slot-seconds available (its current limit x the seconds of the hour inside [p_since,
-- p_until)). Sum both columns over a pool for the pool's utilization.
CREATE OR REPLACE FUNCTION credpool_utilization(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (key_id text, provider text, pool text, hour timestamptz, lease_seconds numeric,
               slot_seconds numeric, utilization numeric)
LANGUAGE sql STABLE AS $$
    WITH lives AS (
        SELECT l.key_id, l.granted_at, coalesce(l.ended_at, now()) AS ended_at
        FROM credpool_lease_lifetimes(p_since, p_until) l
    ),
    hours AS (
        SELECT h AS hour, greatest(h, p_since) AS from_at, least(h + interval '1 hour', p_until) AS to_at
        FROM generate_series(date_trunc('hour', p_since), p_until - interval '1 microsecond', interval '1 hour') h
    ),
    held AS (
        SELECT l.key_id, h.hour,
               sum(extract(epoch FROM least(l.ended_at, h.to_at) - greatest(l.granted_at, h.from_at))) AS lease_seconds
        FROM lives l
        JOIN hours h ON l.granted_at < h.to_at AND l.ended_at > h.from_at
        GROUP BY l.key_id, h.hour
    )
    SELECT c.key_id, c.provider, c.pool, h.hour,
           round(coalesce(held.lease_seconds, 0), 1),
           round(c.max_concurrent_uses * extract(epoch FROM h.to_at - h.from_at), 1),
           round(coalesce(held.lease_seconds, 0)
                 / nullif(c.max_concurrent_uses * extract(epoch FROM h.to_at - h.from_at), 0), 4)
    FROM credentials c
    CROSS JOIN hours h
    LEFT JOIN held ON held.key_id = c.key_id AND held.hour = h.hour
    ORDER BY h.hour, c.key_id
$$;

-- The rate windows credential `p_key_id` had in force at `p_at`, from the trail: what its latest
-- `created` / `updated` row at or before `p_at` set; else what the first such row after `p_at`
-- replaced (its `old`); else `p_now`, its rate_limits now (no change recorded since; passed in:
-- on Citus the credentials are on the workers, and this is asked per grant on the coordinator). A
-- configuration row without `rate_limits` (written before rate windows existed) means no
-- windows: `[]`, never the windows set later. Rows are dated when the change took effect (the operator's transaction
-- writes them after its locks, at clock_timestamp()), so a grant is judged by the windows it was
-- admitted under. Index credential_events_configuration_idx serves both look-ups.
DROP FUNCTION IF EXISTS credpool_rate_limits_at(text, timestamptz);
CREATE OR REPLACE FUNCTION credpool_rate_limits_at(p_key_id text, p_at timestamptz, p_now jsonb)
RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT coalesce(ce.details -> 'new' -> 'rate_limits', '[]')
         FROM credential_events ce
         WHERE ce.key_id = p_key_id AND ce.event IN ('created', 'updated') AND ce.at <= p_at
         ORDER BY ce.at DESC, ce.event_id DESC
         LIMIT 1),
        (SELECT CASE WHEN ce.event = 'updated' THEN coalesce(ce.details -> 'old' -> 'rate_limits', '[]') END
         FROM credential_events ce
         WHERE ce.key_id = p_key_id AND ce.event IN ('created', 'updated') AND ce.at > p_at
         ORDER BY ce.at, ce.event_id
         LIMIT 1),
        p_now,
        '[]')
$$;

-- The rate windows (kind, seconds) a window proof of scope `p_scope` ('credential' or 'tenant')
-- over [p_since, p_until) looks at: every (kind, S) of the scope's current configurations and of
-- its configuration rows before p_until (for credentials, also the `old` of rows from p_since on:
-- credpool_rate_limits_at may answer with it). `p_credentials`: the credentials, or their copy
-- (credpool_scope_lease_check says why).
CREATE OR REPLACE FUNCTION credpool_audit_windows(p_scope text, p_since timestamptz,
    p_until timestamptz, p_credentials regclass DEFAULT 'credentials')
RETURNS TABLE (kind text, seconds integer)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY EXECUTE format($q$
        SELECT DISTINCT CASE WHEN l ? 'requests' THEN 'requests' ELSE 'tokens' END,
               (l ->> 'seconds')::integer
        FROM (SELECT c.rate_limits AS limits FROM %s c
              WHERE $1 = 'credential'
              UNION ALL
              SELECT ce.details -> 'new' -> 'rate_limits' FROM credential_events ce
              WHERE $1 = 'credential'
                AND ce.event IN ('created', 'updated') AND ce.at < $3
                AND jsonb_typeof(ce.details -> 'new' -> 'rate_limits') = 'array'
              UNION ALL
              SELECT ce.details -> 'old' -> 'rate_limits' FROM credential_events ce
              WHERE $1 = 'credential'
                AND ce.event = 'updated' AND ce.at >= $2
                AND jsonb_typeof(ce.details -> 'old' -> 'rate_limits') = 'array'
              UNION ALL
              SELECT t.rate_limits FROM tenants t
              WHERE $1 = 'tenant'
              UNION ALL
              SELECT te.rate_limits FROM tenant_events te
              WHERE $1 = 'tenant'
                AND te.event IN ('created', 'updated') AND te.at < $3
                AND jsonb_typeof(te.rate_limits) = 'array') AS configs,
             jsonb_array_elements(configs.limits) AS l
    $q$, p_credentials)
    USING p_scope, p_since, p_until;
END;
$$;

-- The window proof, from the trail alone, for either scope of rate windows: `p_scope`
-- 'credential' judges the grants of each credential (lease_events.key_id) by the windows the
-- credential had (credpool_rate_limits_at); 'tenant' judges the grants of each tenant over all
-- its credentials (lease_events.tenant; grants without one, from before tenants existed, are not
-- judged) by the windows the tenant had (credpool_tenant_rate_limits_at). credpool_window_check
-- and credpool_tenant_window_check are its two forms; `scope_id` is the key_id or the tenant_id.
--
-- The rule it checks, for every grant in [p_since, p_until) of a credential (tenant) that had
-- rate windows at that moment, and every such window of length S and count N: what the grants of
-- that credential (tenant) in (at - S, at] had charged, as credpool could know it when it
-- granted, is at most N. Each grant charges one for `requests`; for `tokens`, the usage its
-- release (or late report) reported if that report came before this grant, else its reservation
-- — that is, the grant itself and every grant whose usage was not known yet count their
-- reservation. A usage above the reservation counts from the moment it was reported, so a grant
-- admitted after it without room is caught; a usage reported later never counts against an
-- earlier grant. (What upstream consumed may take a window over N after a grant — usage above
-- the estimate — but no grant is made into a window without room.) `grants_over_window` counts
-- the grants that break the rule: it must be 0. `peak` is the most a window had charged at a
-- grant. One row per credential (tenant) and window with grants in the range.
--
-- Exact with respect to the claim: a claim decides on the credential's lease_windows row, locked,
-- whose buckets cover (at - S, at] and more, holding every earlier grant's reservation and every
-- usage reported by a release that committed before the claim took the lock; a release dates its
-- report (`at`) after taking the row's lock, and a claim reads its `at` with the row version it
-- decides on (after the lock, when a release changed the row since the claim's snapshot), so a
-- usage a claim counted is dated before its grant, and one it did not count after. A tenant's
-- windows are exact in the same sense when the claim decides them on a locked row of the tenant's
-- with the same two rules (a report dated after that row's lock too).
--
-- One pass per window length and kind, over the grants since p_since - S: a running sum over
-- edges per credential (tenant) (a grant's charge counts from its grant until S later; a
-- reported difference usage - reservation from its report until its grant is S old), no join of
-- the trail with itself. At equal times the edges that end sort first, then the grants (all
-- grants at one moment count each other), then the reports (a report at the very moment of a
-- grant was not known to it). The windows looked at: credpool_audit_windows. The trail rows come
-- from `p_trail`, the credentials' current windows from `p_credentials` (see
-- credpool_scope_lease_check); without them, from credpool_audit_sources over the range (VOLATILE
-- for that: on Citus it copies the range's rows first).
DROP FUNCTION IF EXISTS credpool_scope_window_check(text, timestamptz, timestamptz);
CREATE OR REPLACE FUNCTION credpool_scope_window_check(p_scope text, p_since timestamptz,
    p_until timestamptz, p_trail regclass DEFAULT NULL, p_credentials regclass DEFAULT NULL)
RETURNS TABLE (scope_id text, kind text, seconds integer, window_count bigint, grants bigint,
               peak bigint, grants_over_window bigint, first_violation_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    -- the lease_events column naming whose windows judge a grant, and the windows that one had in
    -- force at a grant (r.scope_id, r.at): identifiers from this list only, never the caller's
    v_column text;
    v_windows_at text;
    v_spec record;
BEGIN
    IF p_trail IS NULL THEN
        SELECT src.trail, src.credentials INTO p_trail, p_credentials
        FROM credpool_audit_sources(p_since, p_until) src;
    END IF;
    CASE p_scope
        WHEN 'credential' THEN
            v_column := 'key_id';
            -- (the credentials' current windows passed in: on Citus they are on the workers)
            v_windows_at := format(
                'credpool_rate_limits_at(r.scope_id, r.at,
                                         (SELECT c.rate_limits FROM %s c WHERE c.key_id = r.scope_id))',
                p_credentials);
        WHEN 'tenant' THEN
            v_column := 'tenant';
            v_windows_at := 'credpool_tenant_rate_limits_at(r.scope_id, r.at)';
        ELSE
            RAISE EXCEPTION 'unknown window scope: %', p_scope
                USING ERRCODE = 'invalid_parameter_value';
    END CASE;
    FOR v_spec IN
        SELECT w.kind, w.seconds FROM credpool_audit_windows(p_scope, p_since, p_until, p_credentials) w
    LOOP
        RETURN QUERY EXECUTE format($q$
            WITH grants AS (
                SELECT g.%6$I AS scope_id, g.lease_id, g.at,
                       CASE %1$L WHEN 'requests' THEN 1 ELSE coalesce(g.tokens, 0) END AS charge
                FROM %8$s g
                WHERE g.event = 'granted' AND g.%6$I IS NOT NULL
                  AND g.at >= %3$L::timestamptz - %5$L::interval AND g.at < %4$L::timestamptz
            ),
            -- usage - reservation, from the moment it was reported while the grant is in the window
            reports AS (
                SELECT g.scope_id, g.at AS granted_at, u.at AS reported_at, u.tokens - g.charge AS delta
                FROM grants g
                CROSS JOIN LATERAL (
                    SELECT e.at, e.tokens FROM %8$s e
                    WHERE e.lease_id = g.lease_id AND e.tokens IS NOT NULL
                      AND e.event IN ('released', 'outcome_after_expiry')
                      -- only a report within the grant's window and the range counts (the
                      -- WHERE below); bounded here too, so only those days' partitions are read
                      AND e.at >= g.at AND e.at < g.at + %5$L::interval
                      AND e.at < %4$L::timestamptz
                    ORDER BY e.at
                    LIMIT 1) u
                WHERE %1$L = 'tokens'
                  AND u.at < g.at + %5$L::interval AND u.at < %4$L::timestamptz
                  AND u.tokens <> g.charge
            ),
            edges AS (
                SELECT g.scope_id, g.at, 1 AS ord, g.charge AS amount FROM grants g
                UNION ALL
                SELECT g.scope_id, g.at + %5$L::interval, 0, -g.charge FROM grants g
                WHERE g.at + %5$L::interval < %4$L::timestamptz
                UNION ALL
                SELECT r.scope_id, r.reported_at, 2, r.delta FROM reports r
                UNION ALL
                SELECT r.scope_id, r.granted_at + %5$L::interval, 0, -r.delta FROM reports r
                WHERE r.granted_at + %5$L::interval < %4$L::timestamptz
            ),
            running AS (
                SELECT e.scope_id, e.at, e.ord,
                       sum(e.amount) OVER (PARTITION BY e.scope_id ORDER BY e.at, e.ord
                                           RANGE UNBOUNDED PRECEDING) AS charged
                FROM edges e
            ),
            -- MATERIALIZED: the windows in force are looked up once per grant, not once per use
            judged AS MATERIALIZED (
                SELECT r.scope_id, r.at, r.charged,
                       (SELECT (l ->> %1$L)::bigint
                        FROM jsonb_array_elements(%7$s) AS l
                        WHERE l ? %1$L AND (l ->> 'seconds')::integer = %2$s
                        LIMIT 1) AS window_count
                FROM running r
                WHERE r.ord = 1 AND r.at >= %3$L::timestamptz
            )
            SELECT j.scope_id, %1$L::text, %2$s::integer, max(j.window_count), count(*),
                   max(j.charged)::bigint,
                   count(*) FILTER (WHERE j.charged > j.window_count),
                   min(j.at) FILTER (WHERE j.charged > j.window_count)
            FROM judged j
            WHERE j.window_count IS NOT NULL
            GROUP BY j.scope_id
            ORDER BY j.scope_id
        $q$, v_spec.kind, v_spec.seconds, p_since, p_until, make_interval(secs => v_spec.seconds),
             v_column, v_windows_at, p_trail);
    END LOOP;
END;
$$;

-- The window proof of credentials' rate windows (the rule: credpool_scope_window_check, scope
-- 'credential'): one row per credential and window with grants in [p_since, p_until);
-- `grants_over_window` must be 0.
CREATE OR REPLACE FUNCTION credpool_window_check(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (key_id text, kind text, seconds integer, window_count bigint, grants bigint,
               peak bigint, grants_over_window bigint, first_violation_at timestamptz)
LANGUAGE sql AS $$
    SELECT * FROM credpool_scope_window_check('credential', p_since, p_until)
$$;

-- The tenants' trail is append-only too.
DROP TRIGGER IF EXISTS tenant_events_append_only ON tenant_events;
CREATE TRIGGER tenant_events_append_only
    BEFORE UPDATE ON tenant_events
    FOR EACH ROW EXECUTE FUNCTION lease_events_forbid_update();

-- The tenant cap proof, from the trail alone: for every tenant with leases granted in
-- [p_since, p_until), how many, the most it held at one moment, and every grant that left it
-- holding more leases than its cap at that moment (`grants_over_cap`; the rule:
-- credpool_scope_lease_check, scope 'tenant', which also finds the cap in force). The
-- leases live at p_since are read from the day before it, as for credpool_oversell_check.
CREATE OR REPLACE FUNCTION credpool_tenant_cap_check(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (tenant_id text, max_concurrent_leases integer, leases bigint, peak bigint,
               grants_over_cap bigint, first_violation_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_sources record;
BEGIN
    SELECT * INTO v_sources FROM credpool_audit_sources(p_since - interval '1 day', p_until);
    RETURN QUERY
    SELECT j.subject,
           (SELECT t.max_concurrent_leases FROM tenants t WHERE t.tenant_id = j.subject),
           count(*),
           max(j.held),
           count(*) FILTER (WHERE j.held > j.allowed),
           min(j.granted_at) FILTER (WHERE j.held > j.allowed)
    FROM credpool_scope_lease_check('tenant', p_since - interval '1 day', p_until, '{}', p_since,
                                    v_sources.trail, v_sources.credentials) j
    WHERE j.held IS NOT NULL
    GROUP BY j.subject
    ORDER BY j.subject;
END;
$$;

-- The rate windows tenant `p_tenant` had in force at `p_at`, from the trail: what its latest
-- `created` / `updated` tenant_events row at or before `p_at` set (the row carries the
-- configuration in its columns; one without `rate_limits` means no windows: `[]`); else, with no
-- such row, its current rate_limits; else (no such tenant) `[]`. Rows are dated when the change
-- took effect (clock_timestamp() after the change's locks, service/src/store/tenants.rs), so a
-- grant is judged by the windows it was admitted under; retention never removes them. Index
-- tenant_events_tenant_at_idx serves the look-up.
CREATE OR REPLACE FUNCTION credpool_tenant_rate_limits_at(p_tenant text, p_at timestamptz) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT coalesce(te.rate_limits, '[]')
         FROM tenant_events te
         WHERE te.tenant_id = p_tenant AND te.event IN ('created', 'updated') AND te.at <= p_at
         ORDER BY te.at DESC, te.event_id DESC
         LIMIT 1),
        (SELECT t.rate_limits FROM tenants t WHERE t.tenant_id = p_tenant),
        '[]')
$$;

-- The tenant window proof (the rule: credpool_scope_window_check, scope 'tenant'): for every
-- grant in [p_since, p_until) of a tenant that had rate windows then, and each such window of S
-- seconds and count N, what the tenant's grants over all its credentials in (at - S, at] had
-- charged (one per grant for `requests`; reservations, or usage reported before the grant, for
-- `tokens`) is at most N. One row per tenant and window with grants in the range;
-- `grants_over_window` must be 0.
CREATE OR REPLACE FUNCTION credpool_tenant_window_check(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (tenant_id text, kind text, seconds integer, window_count bigint, grants bigint,
               peak bigint, grants_over_window bigint, first_violation_at timestamptz)
LANGUAGE sql AS $$
    SELECT * FROM credpool_scope_window_check('tenant', p_since, p_until)
$$;

-- INCREMENTAL PROOFS. A run (audit_checkpoints: the continuous proof, or one `credpool audit
-- verify` over a range) records per proof up to which time every grant was judged and what was
-- found; each chunk proves the trail rows since, plus the overlap the rules need: the leases live
-- at the checkpoint (carried in the checkpoint row) and a window's lookback (read by time). So a
-- chunk costs what it reads, not what the trail holds, and chunks judge every grant exactly as
-- one proof over the whole range does.

-- The time before which every trail row that any transaction will ever commit is committed now:
-- the start of the oldest transaction still open in this database (a trail row is dated at or
-- after its transaction's start: now(), statement_timestamp() or clock_timestamp()), else the
-- moment of asking. A proof must not pass it, or a grant committed later would be skipped.
-- Sessions of other roles are visible only to their role, superusers and pg_read_all_stats:
-- run proofs as the service's role. Read it in a statement of its own, before the proof's (a
-- transaction that commits between the two is then seen by the proof).
CREATE OR REPLACE FUNCTION credpool_audit_horizon() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_asked timestamptz := clock_timestamp();
BEGIN
    -- pg_stat_activity is read once per transaction unless the snapshot is cleared
    PERFORM pg_stat_clear_snapshot();
    RETURN least(v_asked,
                 (SELECT min(a.xact_start) FROM pg_stat_activity a
                  WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                    AND a.backend_type = 'client backend'));
END;
$$;

-- Where a chunk that starts at p_from ends: after at most p_rows trail rows (the first row after
-- them, whose instant starts the next chunk), else at p_to; and how many rows it holds. Rows of
-- one instant are never split (they may hold more than p_rows). Index lease_events_at_idx.
CREATE OR REPLACE FUNCTION credpool_audit_chunk_end(p_from timestamptz, p_to timestamptz,
    p_rows integer, OUT chunk_end timestamptz, OUT rows_read bigint)
-- PL/pgSQL, one plain read of the trail per statement: Citus plans none of them inside an
-- SQL-language function with parameters, and each runs over every worker there
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_firsts bigint;
    v_last timestamptz;
BEGIN
    SELECT count(*), max(f.at) INTO v_firsts, v_last
    FROM (SELECT e.at FROM lease_events e
          WHERE e.at >= p_from AND e.at < p_to
          ORDER BY e.at
          LIMIT p_rows + 1) f;
    IF v_firsts <= p_rows THEN
        chunk_end := p_to;
        rows_read := v_firsts;
    ELSIF v_last > p_from THEN
        chunk_end := v_last;
        SELECT count(*) INTO rows_read FROM lease_events e
        WHERE e.at >= p_from AND e.at < v_last;
    ELSE
        -- more than p_rows rows at p_from itself: the chunk is that instant
        SELECT coalesce(min(e.at), p_to) INTO chunk_end FROM lease_events e
        WHERE e.at > p_from AND e.at < p_to;
        SELECT count(*) INTO rows_read FROM lease_events e WHERE e.at = p_from;
    END IF;
END;
$$;

-- Opens run `p_run` over [p_since, p_until) (p_until NULL: it follows the trail, as the
-- continuous proof does), one checkpoint per proof; or keeps it when it exists with the same
-- start, unfinished (a proof short of its until_target, or following the trail) and not past
-- p_until, so that an interrupted run resumes (with p_until as its new end). Otherwise the run
-- starts afresh: a finished range is proven again. The concurrency proofs start reading a day
-- before p_since, judging nothing there, to learn the leases live at p_since (a lease renewed for
-- longer than a day is missed, as in credpool_oversell_check). Ranged runs idle for a week are
-- dropped. Returns whether it resumed.
CREATE OR REPLACE FUNCTION credpool_audit_open(p_run text, p_since timestamptz, p_until timestamptz)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_resumed boolean;
BEGIN
    -- waits for a chunk of this run in progress (credpool_audit_advance holds the same lock)
    PERFORM pg_advisory_xact_lock(hashtextextended('credpool.audit:' || p_run, 0));
    SELECT count(*) > 0
           AND bool_and(c.since = p_since AND c.proven_until <= coalesce(p_until, 'infinity'))
           AND bool_or(c.until_target IS NULL OR c.proven_until < c.until_target)
    INTO v_resumed
    FROM audit_checkpoints c WHERE c.run = p_run;
    IF NOT v_resumed THEN
        DELETE FROM audit_checkpoints c WHERE c.run = p_run;
    END IF;
    DELETE FROM audit_checkpoints c
    WHERE c.run LIKE 'range:%' AND c.run <> p_run AND c.updated_at < now() - interval '7 days';
    INSERT INTO audit_checkpoints AS c (run, proof, since, until_target, proven_until)
    SELECT p_run, proof, p_since, p_until,
           CASE WHEN proof IN ('oversell', 'tenant_cap') THEN p_since - interval '1 day' ELSE p_since END
    FROM unnest(ARRAY['oversell', 'windows', 'tenant_cap', 'tenant_windows']) AS proof
    ON CONFLICT (run, proof) DO UPDATE SET until_target = EXCLUDED.until_target;
    RETURN v_resumed;
END;
$$;

-- Where the proofs over [p_from, p_to) (a chunk's, or a one-shot proof's) read the trail and the
-- credentials' current limits and windows: lease_events and credentials themselves on plain
-- PostgreSQL. On Citus
-- (lease_events distributed) a proof's statement cannot join the workers' rows with the
-- coordinator's (credential_events, the checkpoints) nor regroup them by tenant, so the chunk's
-- rows are copied to the coordinator first, in temporary tables dropped at commit: the trail rows
-- from p_from less the longest window any proof of the range looks back, and every credential's
-- limit and windows (one read of each worker apiece); the proofs then judge the copies there,
-- by the same rules.
CREATE OR REPLACE FUNCTION credpool_audit_sources(p_from timestamptz, p_to timestamptz,
    OUT trail regclass, OUT credentials regclass)
LANGUAGE plpgsql AS $$
DECLARE
    v_lookback integer;
BEGIN
    IF NOT credpool_is_distributed('lease_events') THEN
        trail := 'lease_events';
        credentials := 'credentials';
        RETURN;
    END IF;
    DROP TABLE IF EXISTS pg_temp.credpool_audit_trail, pg_temp.credpool_audit_credentials;
    CREATE TEMPORARY TABLE credpool_audit_credentials ON COMMIT DROP AS
        SELECT c.key_id, c.max_concurrent_uses, c.rate_limits FROM credentials c;
    CREATE INDEX ON pg_temp.credpool_audit_credentials (key_id);
    SELECT coalesce(max(w.seconds), 0) INTO v_lookback
    FROM (SELECT cw.seconds FROM credpool_audit_windows('credential', p_from, p_to,
                                                        'pg_temp.credpool_audit_credentials') cw
          UNION ALL
          SELECT tw.seconds FROM credpool_audit_windows('tenant', p_from, p_to) tw) w;
    CREATE TEMPORARY TABLE credpool_audit_trail ON COMMIT DROP AS
        SELECT e.* FROM lease_events e
        WHERE e.at >= p_from - make_interval(secs => v_lookback) AND e.at < p_to;
    CREATE INDEX ON pg_temp.credpool_audit_trail (at);
    CREATE INDEX ON pg_temp.credpool_audit_trail (lease_id, at);
    ANALYZE pg_temp.credpool_audit_trail, pg_temp.credpool_audit_credentials;
    trail := 'pg_temp.credpool_audit_trail';
    credentials := 'pg_temp.credpool_audit_credentials';
END;
$$;

-- One chunk of proof `p_proof` of run p_run: judges the grants in [proven_until, p_to) by the
-- proof's rule (the concurrency proofs, `oversell` and `tenant_cap`, with the leases live at
-- proven_until: credpool_scope_lease_check; the window proofs, `windows` and `tenant_windows`,
-- with each window's lookback read by time: credpool_scope_window_check), adds what it found to
-- the subjects' lines and the checkpoint, keeps the leases live at p_to, and moves the checkpoint
-- to p_to. `p_rows`: the trail rows of the chunk (for progress). `p_trail`, `p_credentials`: where
-- the chunk's rows are read (credpool_audit_sources).
DROP FUNCTION IF EXISTS credpool_audit_prove(text, text, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_audit_prove(p_run text, p_proof text, p_to timestamptz,
    p_rows bigint, p_trail regclass, p_credentials regclass) RETURNS void
LANGUAGE sql
-- a chunk's leases and edges in memory (its rows are bounded): no sort spills to disk
SET work_mem = '64MB'
AS $$
    WITH checkpoint AS (
        SELECT c.* FROM audit_checkpoints c WHERE c.run = p_run AND c.proof = p_proof
    ),
    leases AS MATERIALIZED (
        SELECT j.*
        FROM checkpoint c,
             credpool_scope_lease_check(CASE c.proof WHEN 'oversell' THEN 'credential' ELSE 'tenant' END,
                                        c.proven_until, p_to, c.live_leases, c.since,
                                        p_trail, p_credentials) j
        WHERE c.proof IN ('oversell', 'tenant_cap')
    ),
    found AS MATERIALIZED (
        SELECT j.subject, '' AS kind, 0 AS seconds, NULL::bigint AS window_count,
               count(*) AS grants, max(j.held) AS peak,
               count(*) FILTER (WHERE j.held > j.allowed) AS violations,
               min(j.granted_at) FILTER (WHERE j.held > j.allowed) AS first_violation_at
        FROM leases j
        WHERE j.held IS NOT NULL
        GROUP BY j.subject
        UNION ALL
        SELECT w.scope_id, w.kind, w.seconds, w.window_count, w.grants, w.peak,
               w.grants_over_window, w.first_violation_at
        FROM checkpoint c,
             credpool_scope_window_check(CASE c.proof WHEN 'windows' THEN 'credential' ELSE 'tenant' END,
                                         c.proven_until, p_to, p_trail, p_credentials) w
        WHERE c.proof IN ('windows', 'tenant_windows')
    ),
    merged AS (
        INSERT INTO audit_checkpoint_subjects AS s
            (run, proof, subject, kind, seconds, window_count, grants, peak, violations,
             first_violation_at)
        SELECT p_run, p_proof, f.subject, f.kind, f.seconds, f.window_count, f.grants, f.peak,
               f.violations, f.first_violation_at
        FROM found f
        ON CONFLICT (run, proof, subject, kind, seconds) DO UPDATE
        SET window_count = greatest(s.window_count, EXCLUDED.window_count),
            grants = s.grants + EXCLUDED.grants,
            peak = greatest(s.peak, EXCLUDED.peak),
            violations = s.violations + EXCLUDED.violations,
            first_violation_at = least(s.first_violation_at, EXCLUDED.first_violation_at)
    )
    UPDATE audit_checkpoints c
    SET proven_until = p_to,
        live_leases = coalesce(
            (SELECT array_agg(ROW(j.lease_id, j.subject, j.granted_at, j.lease_until)::audit_live_lease)
             FROM leases j
             WHERE j.released_at IS NULL AND j.lease_until > p_to), '{}'),
        grants = c.grants + coalesce((SELECT sum(f.grants) FROM found f), 0),
        violations = c.violations + coalesce((SELECT sum(f.violations) FROM found f), 0),
        first_violation_at = least(c.first_violation_at,
                                   (SELECT min(f.first_violation_at) FROM found f)),
        rows_read = c.rows_read + p_rows,
        chunks = c.chunks + 1,
        updated_at = now()
    WHERE c.run = p_run AND c.proof = p_proof
$$;

-- Advances every proof of run p_run by one chunk of at most p_rows trail rows, towards its
-- until_target but never past credpool_audit_horizon(); the continuous proof (`continuous`) is
-- opened on first use, from the trail's oldest row or a day ago, whichever is later. Each chunk
-- commits with the caller's statement, so an interrupted run resumes from its last chunk.
-- `rows_read`: the trail rows of the chunk (the most any proof read: each reads its chunk); NULL
-- when another session is advancing this run right now (nothing done). `more`: a proof stopped
-- short of its target (call again).
-- Must run in READ COMMITTED: its statements after the horizon's need snapshots of their own.
CREATE OR REPLACE FUNCTION credpool_audit_advance(p_run text, p_rows integer,
    OUT rows_read bigint, OUT more boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_horizon timestamptz;
    v_checkpoint record;
    v_target timestamptz;
    v_from timestamptz;
    v_to timestamptz;
    v_rows bigint;
    v_sources record;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'credpool_audit_advance needs READ COMMITTED'
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('credpool.audit:' || p_run, 0)) THEN
        RETURN;
    END IF;
    v_horizon := credpool_audit_horizon();
    IF p_run = 'continuous' THEN
        PERFORM credpool_audit_open(p_run, coalesce(
            (SELECT min(c.since) FROM audit_checkpoints c WHERE c.run = p_run),
            greatest((SELECT min(e.at) FROM lease_events e), now() - interval '1 day')), NULL);
    END IF;
    rows_read := 0;
    more := false;
    FOR v_checkpoint IN
        SELECT c.proof, c.proven_until, least(coalesce(c.until_target, v_horizon), v_horizon) AS target
        FROM audit_checkpoints c
        WHERE c.run = p_run
        ORDER BY c.proven_until, c.proof
        FOR UPDATE
    LOOP
        CONTINUE WHEN v_checkpoint.proven_until >= v_checkpoint.target;
        -- proofs at the same point share one chunk
        IF v_from IS DISTINCT FROM v_checkpoint.proven_until OR v_target IS DISTINCT FROM v_checkpoint.target THEN
            v_from := v_checkpoint.proven_until;
            v_target := v_checkpoint.target;
            SELECT e.chunk_end, e.rows_read INTO v_to, v_rows
            FROM credpool_audit_chunk_end(v_from, v_target, p_rows) e;
            SELECT * INTO v_sources FROM credpool_audit_sources(v_from, v_to);
        END IF;
        PERFORM credpool_audit_prove(p_run, v_checkpoint.proof, v_to, v_rows, v_sources.trail,
                                     v_sources.credentials);
        rows_read := greatest(rows_read, v_rows);
        more := more OR v_to < v_target;
    END LOOP;
END;
$$;
