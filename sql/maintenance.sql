-- The cleanup pass that pg_cron (or, without it, the service itself) runs every minute, and its
-- parts. Every function here is safe to run concurrently with itself and with allocation. It
-- never makes a claim wait: it takes rows with SKIP LOCKED and advisory locks with a try-lock,
-- and a credential row FOR NO KEY UPDATE, or FOR UPDATE only together with every slot row of the
-- credential (the refit, sql/fit.sql), so never against the key share lock that a claim's new
-- affinity binding takes on the credential row of the slot it holds. It waits for a claim only
-- where it ends leases or fits slot rows (the reaper's END, the refits): for the tenant slot rows
-- of those leases, which a claim may hold until it commits (milliseconds; lock order 4,
-- docs/design.md). It works in bounded batches, returns how much it did, and doing it twice does
-- nothing more the second time.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one transaction;
-- every statement here must be safe to run again. It comes after the files of the lease
-- path (sql/locks.sql .. sql/tenants.sql) and sql/pools.sql, whose functions it calls.

-- Records, once per cooldown, that a credential's cooldown has ended (`cooldown_ended`). The
-- credential is usable again from that moment without this job (credential_usable); it stays
-- half-open — its next lease is a single probe, and its status returns to `available` when the
-- probe succeeds — so this job does not change the status, it makes the recovery visible in the
-- trail. Each credential row is taken FOR NO KEY UPDATE SKIP LOCKED (two passes never record one
-- cooldown twice, and neither waits): its key does not change, and a stronger lock (FOR UPDATE)
-- would make a claim that binds a conversation to the credential wait for this pass (the binding's
-- foreign key takes a key share lock on the credential row). Returns how many credentials it
-- recorded.
-- In steps: the due credentials, read; those with no record yet, oldest first (the records are
-- the coordinator's, which a statement on a worker cannot read); then, provider by provider (on
-- Citus each provider's rows are locked on its worker), their rows locked, the cooldown checked
-- again on the locked row, and recorded.
DROP FUNCTION IF EXISTS credpool_recover_cooldowns(integer);
CREATE FUNCTION credpool_recover_cooldowns(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_due record;
    v_got record;
    v_provider text;
    v_recorded integer := 0;
    v_n integer;
    v_now timestamptz := now();
BEGIN
    SELECT coalesce(array_agg(c.provider), '{}') AS providers,
           coalesce(array_agg(c.key_id), '{}') AS keys,
           coalesce(array_agg(c.cooldown_until), '{}') AS ends
    INTO v_due
    FROM credentials c
    WHERE c.status IN ('rate_limited', 'cooldown', 'exhausted') AND c.cooldown_until <= v_now;
    SELECT coalesce(array_agg(d.provider ORDER BY d.cooldown_until), '{}') AS providers,
           coalesce(array_agg(d.key_id ORDER BY d.cooldown_until), '{}') AS keys,
           coalesce(array_agg(d.cooldown_until ORDER BY d.cooldown_until), '{}') AS ends
    INTO v_due
    FROM (SELECT d.*
          FROM unnest(v_due.providers, v_due.keys, v_due.ends) AS d (provider, key_id, cooldown_until)
          WHERE NOT EXISTS (
              SELECT 1 FROM credential_events e
              WHERE e.key_id = d.key_id AND e.event = 'cooldown_ended'
                AND e.cooldown_until = d.cooldown_until)
          ORDER BY d.cooldown_until
          LIMIT p_batch) AS d;
    FOR v_provider IN SELECT DISTINCT x FROM unnest(v_due.providers) AS x ORDER BY 1 LOOP
        SELECT coalesce(array_agg(c.key_id), '{}') AS keys,
               coalesce(array_agg(c.cooldown_until), '{}') AS ends,
               coalesce(array_agg(c.status), '{}') AS statuses
        INTO v_got
        FROM (SELECT c.key_id, c.cooldown_until, c.status
              FROM credentials c
              JOIN unnest(v_due.providers, v_due.keys, v_due.ends) AS d (provider, key_id, cooldown_until)
                ON c.key_id = d.key_id AND c.cooldown_until = d.cooldown_until
              WHERE c.provider = v_provider AND d.provider = v_provider
                AND c.status IN ('rate_limited', 'cooldown', 'exhausted')
              FOR NO KEY UPDATE OF c SKIP LOCKED) AS c;
        INSERT INTO credential_events (key_id, event, old_status, new_status, reason, cooldown_until, at)
        SELECT g.key_id, 'cooldown_ended', g.status, g.status,
               'cooldown ended: usable again, half-open (the next lease is a single probe)',
               g.cooldown_until, v_now
        FROM unnest(v_got.keys, v_got.ends, v_got.statuses) AS g (key_id, cooldown_until, status);
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_recorded := v_recorded + v_n;
    END LOOP;
    RETURN v_recorded;
END;
$$;

-- The partitions of the lease trail, one per UTC day of `at` (and `lease_events_before`, the
-- trail written before it was partitioned, from MINVALUE): each with the range of `at` it holds,
-- [day_from, day_to); day_from NULL for MINVALUE.
CREATE OR REPLACE FUNCTION credpool_trail_days(OUT day regclass, OUT day_from timestamptz,
    OUT day_to timestamptz)
RETURNS SETOF record
LANGUAGE sql STABLE AS $$
    SELECT c.oid::regclass,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
    FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'lease_events'::regclass
$$;

-- Makes the trail's partitions for today and the next p_days UTC days that do not exist yet, so
-- that a grant never finds no partition for its row (the trail has no default partition: one
-- would have to be scanned, under a lock every trail reader waits behind, whenever a day is
-- added). Each day is created on its own and then attached, which takes only a SHARE UPDATE
-- EXCLUSIVE lock on the trail: claims, releases and proofs go on meanwhile. A day another
-- session is adding (the attach waits more than a second) is left for the next pass. p_now: the
-- clock. Returns how many days it made.
CREATE OR REPLACE FUNCTION credpool_make_trail_days(p_days integer DEFAULT 7,
    p_now timestamptz DEFAULT now())
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_today timestamptz := date_trunc('day', p_now AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    v_day timestamptz;
    v_name text;
    v_made integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    FOR i IN 0..p_days LOOP
        v_day := v_today + make_interval(days => i);
        CONTINUE WHEN EXISTS (SELECT 1 FROM credpool_trail_days() d
                              WHERE coalesce(d.day_from, '-infinity') < v_day + interval '1 day'
                                AND d.day_to > v_day);
        v_name := 'lease_events_p' || to_char(v_day AT TIME ZONE 'UTC', 'YYYYMMDD');
        BEGIN
            EXECUTE format('CREATE TABLE %I (LIKE lease_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                           v_name);
            EXECUTE format('ALTER TABLE lease_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           v_name, v_day, v_day + interval '1 day');
            v_made := v_made + 1;
        EXCEPTION WHEN lock_not_available OR duplicate_table THEN
            RETURN v_made;
        END;
    END LOOP;
    RETURN v_made;
END;
$$;

-- Drops the trail's days that retention has passed: every row older than now() - p_retention,
-- oldest first. Keeps a day that holds the grant of a lease still in its slot (its trail is
-- whole until it ends), and every day the continuous proof has not proven yet (a proof held back
-- keeps the trail growing; the CredpoolAuditProofBehind alert says so).
-- Dropping a day takes an ACCESS EXCLUSIVE lock on the trail for a moment; it waits for it at
-- most 100 ms (a proof reading the trail holds it off: the day is dropped by a later pass), so
-- claims and releases queue behind it no longer than that. p_now: the clock. Returns how many
-- days it dropped.
CREATE OR REPLACE FUNCTION credpool_drop_trail_days(p_retention interval DEFAULT '30 days',
    p_now timestamptz DEFAULT now())
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_keep_from timestamptz := p_now - p_retention;
    v_day record;
    v_dropped integer := 0;
BEGIN
    v_keep_from := least(v_keep_from,
                         (SELECT min(s.granted_at) FROM lease_slots s WHERE s.lease_id IS NOT NULL),
                         (SELECT min(c.proven_until) FROM audit_checkpoints c
                          WHERE c.run = 'continuous'));
    PERFORM set_config('lock_timeout', '100ms', true);
    FOR v_day IN SELECT d.day, d.day_to FROM credpool_trail_days() d
                 WHERE d.day_to <= v_keep_from ORDER BY d.day_to LOOP
        BEGIN
            EXECUTE format('DROP TABLE %s', v_day.day);
            v_dropped := v_dropped + 1;
        EXCEPTION
            WHEN lock_not_available THEN
                RETURN v_dropped;
            WHEN undefined_table THEN
                NULL; -- another session dropped it first
        END;
    END LOOP;
    RETURN v_dropped;
END;
$$;

-- Deletes up to p_batch rows of the trail written before it was partitioned
-- (`lease_events_before`, until credpool_drop_trail_days drops it whole) and of the credential
-- trail older than p_retention. Never touches the history of a lease that still holds a slot, nor
-- trail rows the continuous proof has not proven yet. Returns how many rows it deleted.
CREATE OR REPLACE FUNCTION credpool_purge_audit(p_retention interval DEFAULT '30 days', p_batch integer DEFAULT 10000)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_leases integer := 0;
    v_deleted integer;
    v_credentials integer;
    v_provider text;
    v_doomed record;
BEGIN
    IF to_regclass('lease_events_before') IS NOT NULL THEN
        -- the rows, read; then deleted provider by provider (on Citus a row's ctid names it only
        -- within its provider's shard)
        SELECT coalesce(array_agg(e.provider), '{}') AS providers,
               coalesce(array_agg(e.ctid), '{}') AS ctids
        INTO v_doomed
        FROM (SELECT e.provider, e.ctid
              FROM lease_events_before e
              WHERE e.at < now() - p_retention
                AND e.at < coalesce((SELECT min(c.proven_until) FROM audit_checkpoints c
                                     WHERE c.run = 'continuous'), 'infinity')
                AND NOT EXISTS (SELECT 1 FROM lease_slots s
                                WHERE s.provider = e.provider AND s.key_id = e.key_id
                                  AND s.lease_id = e.lease_id)
              ORDER BY e.at
              LIMIT p_batch) AS e;
        FOR v_provider IN SELECT DISTINCT x FROM unnest(v_doomed.providers) AS x ORDER BY 1 LOOP
            DELETE FROM lease_events_before
            WHERE provider = v_provider
              AND ctid = ANY (ARRAY(SELECT d.ctid
                                    FROM unnest(v_doomed.providers, v_doomed.ctids) AS d (provider, ctid)
                                    WHERE d.provider = v_provider));
            GET DIAGNOSTICS v_deleted = ROW_COUNT;
            v_leases := v_leases + v_deleted;
        END LOOP;
    END IF;

    WITH doomed AS (
        SELECT event_id FROM credential_events
        WHERE at < now() - p_retention
        ORDER BY at
        LIMIT p_batch
    )
    DELETE FROM credential_events WHERE event_id IN (SELECT event_id FROM doomed);
    GET DIAGNOSTICS v_credentials = ROW_COUNT;
    RETURN v_leases + v_credentials;
END;
$$;

-- Deletes up to p_batch request ids whose lease has ended (it no longer holds a slot, or has
-- expired) and that were granted more than p_keep ago: such a request_id is free already (a retry
-- would get a new lease), the row is only storage. Each row is deleted under its request_id's
-- advisory lock, taken with a try-lock like a claim's, so a claim writing the row is never waited
-- for, and never waits. Returns how many rows it deleted.
-- (In three statements: the rows, read; their request ids' advisory locks, tried in a statement of
-- their own (on Citus, on the coordinator, where a claim takes them); the rows got, deleted,
-- provider by provider, ascending: on Citus each provider's rows live on its worker.)
DROP FUNCTION IF EXISTS credpool_purge_requests(interval, integer);
CREATE FUNCTION credpool_purge_requests(p_keep interval DEFAULT '1 hour', p_batch integer DEFAULT 10000)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_doomed record;
    v_provider text;
    v_deleted integer := 0;
    v_n integer;
BEGIN
    SELECT coalesce(array_agg(r.provider), '{}') AS providers,
           coalesce(array_agg(r.tenant), '{}') AS tenants,
           coalesce(array_agg(r.request_id), '{}') AS ids
    INTO v_doomed
    FROM (SELECT r.provider, r.tenant, r.request_id
          FROM lease_requests r
          WHERE r.granted_at < now() - p_keep
            AND NOT EXISTS (SELECT 1 FROM lease_slots s
                            WHERE s.provider = r.provider AND s.key_id = r.key_id
                              AND s.lease_id = r.lease_id AND s.lease_until > now())
          ORDER BY r.granted_at
          LIMIT p_batch) AS r;
    SELECT coalesce(array_agg(d.provider), '{}') AS providers,
           coalesce(array_agg(d.tenant), '{}') AS tenants,
           coalesce(array_agg(d.request_id), '{}') AS ids
    INTO v_doomed
    FROM unnest(v_doomed.providers, v_doomed.tenants, v_doomed.ids) AS d (provider, tenant, request_id)
    WHERE pg_try_advisory_xact_lock(
              hashtextextended('credpool.request_id:' || d.tenant || '/' || d.request_id, 0));
    FOR v_provider IN SELECT DISTINCT x FROM unnest(v_doomed.providers) AS x ORDER BY 1 LOOP
        DELETE FROM lease_requests r
        USING unnest(v_doomed.providers, v_doomed.tenants, v_doomed.ids)
              AS d (provider, tenant, request_id)
        WHERE r.provider = v_provider AND d.provider = v_provider
          AND r.tenant = d.tenant AND r.request_id = d.request_id
          -- again on the row as it is now: a claim that granted it anew meanwhile wins
          AND r.granted_at < now() - p_keep;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_deleted := v_deleted + v_n;
    END LOOP;
    RETURN v_deleted;
END;
$$;

-- AFFINITY: deletes up to p_batch affinity bindings that have expired, then, while more
-- than the cap of live bindings remain, up to p_batch of the least recently hit ones, so the table
-- stays bounded. The cap: p_cap, else the setting `credpool.affinity_max_bindings` (e.g.
-- `ALTER DATABASE credpool SET credpool.affinity_max_bindings = 5000000`), else 1,000,000. Each
-- row is deleted under its affinity key's advisory lock, tried, and its row lock, taken with SKIP
-- LOCKED, like a claim's write of it: this pass never waits for a claim and a claim never waits for
-- it (a binding a claim is writing right now is left for the next pass). The row lock is FOR
-- UPDATE, as a delete needs; no foreign key points at a binding, so no key share lock meets it.
-- Counting the live bindings reads the table once per pass. Returns how many rows it deleted.
-- (In steps: the candidates, read through their index; then, provider by provider, ascending (on
-- Citus each provider's rows live on its worker), PURGE BINDINGS.)
DROP FUNCTION IF EXISTS credpool_purge_affinity(bigint, integer);
CREATE FUNCTION credpool_purge_affinity(p_cap bigint DEFAULT NULL, p_batch integer DEFAULT 10000)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_cap bigint := coalesce(p_cap,
        nullif(current_setting('credpool.affinity_max_bindings', true), '')::bigint, 1000000);
    v_over bigint;
    v_doomed record;
    v_deleted integer;
BEGIN
    SELECT coalesce(array_agg(b.provider), '{}') AS providers,
           coalesce(array_agg(b.tenant), '{}') AS tenants,
           coalesce(array_agg(b.pool), '{}') AS pools,
           coalesce(array_agg(b.affinity_key), '{}') AS keys
    INTO v_doomed
    FROM (SELECT b.provider, b.tenant, b.pool, b.affinity_key
          FROM affinity_bindings b
          WHERE b.expires_at <= now()
          ORDER BY b.expires_at
          LIMIT p_batch) AS b;
    v_deleted := credpool_purge_bindings(v_doomed.providers, v_doomed.tenants, v_doomed.pools,
                                         v_doomed.keys, true);

    SELECT count(*) - v_cap INTO v_over FROM affinity_bindings WHERE expires_at > now();
    IF v_over > 0 THEN
        SELECT coalesce(array_agg(b.provider), '{}') AS providers,
               coalesce(array_agg(b.tenant), '{}') AS tenants,
               coalesce(array_agg(b.pool), '{}') AS pools,
               coalesce(array_agg(b.affinity_key), '{}') AS keys
        INTO v_doomed
        FROM (SELECT b.provider, b.tenant, b.pool, b.affinity_key
              FROM affinity_bindings b
              ORDER BY b.last_hit_at
              LIMIT least(v_over, p_batch)) AS b;
        v_deleted := v_deleted + credpool_purge_bindings(v_doomed.providers, v_doomed.tenants,
                                                         v_doomed.pools, v_doomed.keys, false);
    END IF;
    RETURN v_deleted;
END;
$$;

-- PURGE BINDINGS: deletes the bindings named by element i of each array, provider by provider,
-- ascending: the rows, locked with SKIP LOCKED (with `p_expired_only`, only those still expired on
-- the locked row: a claim's hit since the read keeps it), then their keys' advisory locks, tried
-- in a statement of their own (on Citus, on the coordinator, where a claim takes them), then the
-- rows got, deleted. Returns how many it deleted.
CREATE OR REPLACE FUNCTION credpool_purge_bindings(p_providers text[], p_tenants text[],
    p_pools text[], p_keys text[], p_expired_only boolean)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_provider text;
    v_got record;
    v_deleted integer := 0;
    v_n integer;
BEGIN
    FOR v_provider IN SELECT DISTINCT x FROM unnest(p_providers) AS x ORDER BY 1 LOOP
        SELECT coalesce(array_agg(b.tenant), '{}') AS tenants,
               coalesce(array_agg(b.pool), '{}') AS pools,
               coalesce(array_agg(b.affinity_key), '{}') AS keys
        INTO v_got
        FROM (SELECT b.tenant, b.pool, b.affinity_key
              FROM affinity_bindings b
              JOIN unnest(p_providers, p_tenants, p_pools, p_keys)
                   AS d (provider, tenant, pool, affinity_key)
                ON b.tenant = d.tenant AND b.pool = d.pool AND b.affinity_key = d.affinity_key
              WHERE b.provider = v_provider AND d.provider = v_provider
                AND (NOT p_expired_only OR b.expires_at <= now())
              FOR UPDATE OF b SKIP LOCKED) AS b;
        SELECT coalesce(array_agg(d.tenant), '{}') AS tenants,
               coalesce(array_agg(d.pool), '{}') AS pools,
               coalesce(array_agg(d.affinity_key), '{}') AS keys
        INTO v_got
        FROM unnest(v_got.tenants, v_got.pools, v_got.keys) AS d (tenant, pool, affinity_key)
        WHERE pg_try_advisory_xact_lock(
                  credpool_affinity_lock(d.tenant, v_provider, d.pool, d.affinity_key));
        DELETE FROM affinity_bindings b
        USING unnest(v_got.tenants, v_got.pools, v_got.keys) AS d (tenant, pool, affinity_key)
        WHERE b.provider = v_provider AND b.tenant = d.tenant AND b.pool = d.pool
          AND b.affinity_key = d.affinity_key;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_deleted := v_deleted + v_n;
    END LOOP;
    RETURN v_deleted;
END;
$$;

-- The steps of one maintenance pass, in order: reap expired leases, refit credentials back under
-- a lowered limit, record ended cooldowns, purge old audit rows and request ids, fold the pool
-- versions of exited backends, refit tenants over a lowered cap, purge expired affinity bindings
-- and keep them under their cap, make the trail's days a week ahead, advance the continuous proof
-- by one chunk of at most 200,000 trail rows per proof (credpool_audit_advance; `done` is the
-- trail rows it read, and `more` says that it stopped short of the trail's end: callers repeat
-- the step while their pass has time), and drop the trail's days retention has passed.
-- Step `p_step` (1-based) runs and returns its name and how much it did; past the last step, both
-- are NULL. Each step is meant to be its own transaction (credpool_maintenance, and the service's
-- own scheduler, commit after each), so that the row locks of one step are gone before the next
-- starts: a long audit purge never holds the slot rows the reaper ended, and no claim passes over
-- a free slot, or answers 429, because a cleanup pass is running. A step that another session is
-- running right now (the same advisory lock, tried, never waited for) is skipped: `done` is NULL.
DROP FUNCTION IF EXISTS credpool_maintenance_step(integer, interval);
CREATE OR REPLACE FUNCTION credpool_maintenance_step(p_step integer, p_retention interval,
    OUT name text, OUT done integer, OUT more boolean)
LANGUAGE plpgsql AS $$
BEGIN
    more := false;
    name := (ARRAY['expired_leases_reaped', 'credentials_refitted', 'cooldowns_recorded',
                   'audit_rows_purged', 'request_ids_purged', 'pool_versions_folded',
                   'tenants_refitted', 'affinity_bindings_purged', 'trail_days_made',
                   'audit_rows_proven', 'trail_days_dropped'])[p_step];
    IF name IS NULL THEN
        RETURN;
    END IF;
    IF name = 'audit_rows_proven' THEN
        -- the proof's own lock (per run) makes one session advance it at a time
        SELECT a.rows_read::integer, coalesce(a.more, false) INTO done, more
        FROM credpool_audit_advance('continuous', 200000) a;
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('credpool.maintenance:' || name, 0)) THEN
        RETURN;
    END IF;
    done := CASE name
        WHEN 'expired_leases_reaped' THEN credpool_reap_expired_leases(1000)
        WHEN 'credentials_refitted' THEN credpool_refit_over_limit(100)
        WHEN 'tenants_refitted' THEN credpool_refit_tenants(100)
        WHEN 'cooldowns_recorded' THEN credpool_recover_cooldowns(1000)
        WHEN 'audit_rows_purged' THEN credpool_purge_audit(p_retention, 10000)
        WHEN 'request_ids_purged' THEN credpool_purge_requests('1 hour', 10000)
        WHEN 'pool_versions_folded' THEN credpool_compact_pool_versions()
        WHEN 'affinity_bindings_purged' THEN credpool_purge_affinity(NULL, 10000)
        WHEN 'trail_days_made' THEN credpool_make_trail_days(7)
        WHEN 'trail_days_dropped' THEN credpool_drop_trail_days(p_retention)
    END;
END;
$$;

-- One maintenance pass, as pg_cron runs it (`CALL credpool_maintenance(...)`, alone in its
-- command, so that it may commit): every step of credpool_maintenance_step, each committed before
-- the next; a step that says it has `more` to do runs again, committed each time, while the pass
-- is younger than `p_seconds` (the service's own scheduler uses the same bound:
-- service/src/store/maintenance.rs). `report`: what each step did, {"expired_leases_reaped": n, ...}.
DROP FUNCTION IF EXISTS credpool_maintenance(interval);
DROP PROCEDURE IF EXISTS credpool_maintenance(interval, jsonb);
CREATE OR REPLACE PROCEDURE credpool_maintenance(p_retention interval DEFAULT '30 days',
    INOUT report jsonb DEFAULT NULL, p_seconds double precision DEFAULT 30)
LANGUAGE plpgsql AS $$
DECLARE
    v_step record;
    v_started timestamptz := clock_timestamp();
    i integer := 1;
BEGIN
    report := '{}';
    LOOP
        SELECT * INTO v_step FROM credpool_maintenance_step(i, p_retention);
        EXIT WHEN v_step.name IS NULL;
        report := report || jsonb_build_object(v_step.name,
            coalesce((report ->> v_step.name)::bigint, 0) + coalesce(v_step.done, 0));
        COMMIT;
        IF NOT v_step.more OR clock_timestamp() > v_started + make_interval(secs => p_seconds) THEN
            i := i + 1;
        END IF;
    END LOOP;
END;
$$;
