-- Pool versions and the notifications that wake waiting allocations.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one transaction;
-- every statement here must be safe to run again.

-- A service keeps a view of each pool's candidates; the claim returns the pool's version so the
-- service learns that its view is stale from the statement it runs anyway. The version moves with
-- every committed change to who may be leased (membership, models, limit, status, cooldown,
-- draining, rate windows, a refit under a lowered limit). Occupancy and the decaying health counters do not
-- move it: they only steer ranking, and a periodic refresh catches up with them.
--
-- A pool's version is the sum of its pool_versions rows, one per backend (see the table's
-- comment): the bump below touches only the row of the calling backend, which no concurrent
-- transaction can hold, so it never waits and adds no lock to the lock order (docs/design.md).
--
-- (PL/pgSQL rather than SQL here and in the other functions a claim or a release calls: a SQL
-- function that cannot be inlined is planned again at every call, a PL/pgSQL one keeps its plans.)
CREATE OR REPLACE FUNCTION credpool_bump_pool_version(p_provider text, p_pool text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pool_versions AS v (provider, pool, backend, version)
    VALUES (p_provider, p_pool, pg_backend_pid(), 1)
    ON CONFLICT ON CONSTRAINT pool_versions_pkey DO UPDATE SET version = v.version + 1;
END;
$$;

-- The version of one pool: NULL when the pool never had a credential.
CREATE OR REPLACE FUNCTION credpool_pool_version(p_provider text, p_pool text) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT sum(v.version)::bigint FROM pool_versions v
            WHERE v.provider = p_provider AND v.pool = p_pool);
END;
$$;

-- Folds the rows of backends that have exited into row 0 of their pool, so the table stays as
-- small as the set of live backends. The sum of every pool is unchanged (one transaction). A row
-- whose backend number a new backend has taken again is locked by it (SKIP LOCKED passes over
-- it) or folded before the new backend bumps it (which then inserts a fresh row). Row 0 is
-- written only here, and the maintenance pass runs one at a time. Returns the rows folded.
-- Provider by provider (on Citus, each on its worker, whose backends write its rows).
DROP FUNCTION IF EXISTS credpool_compact_pool_versions();
CREATE FUNCTION credpool_compact_pool_versions() RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_provider text;
    v_pools text[];
    v_backends integer[];
    v_live integer[];
    v_versions bigint[];
    v_folded integer := 0;
    v_n integer;
BEGIN
    -- the live backends, read first (on Citus, the coordinator's: a row a worker's backend
    -- bumped is folded at every pass, which is safe: a fold keeps the pool's sum, and the
    -- backend's next bump starts a fresh row)
    v_live := ARRAY(SELECT a.pid FROM pg_stat_activity a);
    FOR v_provider IN SELECT DISTINCT v.provider FROM pool_versions v ORDER BY 1 LOOP
        -- (in statements of their own, each on one provider's rows: Citus takes neither a
        -- modifying CTE fed by a locking one nor an INSERT fed by a modifying CTE)
        SELECT coalesce(array_agg(v.pool), '{}'), coalesce(array_agg(v.backend), '{}')
        INTO v_pools, v_backends
        FROM (SELECT v.pool, v.backend
              FROM pool_versions v
              WHERE v.provider = v_provider AND v.backend <> 0 AND v.backend <> ALL (v_live)
              ORDER BY v.pool, v.backend
              FOR UPDATE SKIP LOCKED) AS v;
        CONTINUE WHEN v_pools = '{}';
        WITH folded AS (
            DELETE FROM pool_versions v
            USING unnest(v_pools, v_backends) AS g (pool, backend)
            WHERE v.provider = v_provider AND v.pool = g.pool AND v.backend = g.backend
            RETURNING v.pool, v.version
        )
        SELECT coalesce(array_agg(f.pool), '{}'), coalesce(array_agg(f.version), '{}')
        INTO v_pools, v_versions
        FROM folded f;
        v_n := cardinality(v_pools);
        -- (a statement of its own: Citus takes no INSERT fed by a modifying CTE)
        INSERT INTO pool_versions AS v (provider, pool, backend, version)
        SELECT v_provider, f.pool, 0, sum(f.version)
        FROM unnest(v_pools, v_versions) AS f (pool, version)
        GROUP BY f.pool
        ON CONFLICT ON CONSTRAINT pool_versions_pkey DO UPDATE SET version = v.version + EXCLUDED.version;
        v_folded := v_folded + v_n;
    END LOOP;
    RETURN v_folded;
END;
$$;

CREATE OR REPLACE FUNCTION credentials_bump_pool_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM credpool_bump_pool_version(OLD.provider, OLD.pool);
    END IF;
    IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND (NEW.provider, NEW.pool) IS DISTINCT FROM (OLD.provider, OLD.pool)) THEN
        PERFORM credpool_bump_pool_version(NEW.provider, NEW.pool);
    END IF;
    RETURN NULL;
END;
$$;

-- Whether an update changes who may be leased from the credential: what moves its pool's version
-- (and stamps the row for the incremental read below). Its rows are `anyelement`, not
-- `credentials`: on Citus a trigger fires on a shard, whose rows are of the shard's own type
-- (`credentials_102008`), and a function of `credentials` would not take them.
DROP TRIGGER IF EXISTS credentials_selection_changed ON credentials;
DROP TRIGGER IF EXISTS credentials_stamp_update ON credentials;
DROP FUNCTION IF EXISTS credentials_selection_moved(credentials, credentials);
CREATE OR REPLACE FUNCTION credentials_selection_moved(o anyelement, n anyelement) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT (o.provider, o.pool, o.models, o.model_aliases, o.max_concurrent_uses,
            o.status, o.cooldown_until, o.draining, o.rate_limits)
           IS DISTINCT FROM
           (n.provider, n.pool, n.models, n.model_aliases, n.max_concurrent_uses,
            n.status, n.cooldown_until, n.draining, n.rate_limits)
$$;

DROP TRIGGER IF EXISTS credentials_membership_changed ON credentials;
CREATE TRIGGER credentials_membership_changed
    AFTER INSERT OR DELETE ON credentials
    FOR EACH ROW EXECUTE FUNCTION credentials_bump_pool_version();

DROP TRIGGER IF EXISTS credentials_selection_changed ON credentials;
CREATE TRIGGER credentials_selection_changed
    AFTER UPDATE ON credentials
    FOR EACH ROW
    WHEN (credentials_selection_moved(OLD, NEW))
    EXECUTE FUNCTION credentials_bump_pool_version();

-- What the incremental read of a pool's candidates looks for (the versioned migration that made
-- `credentials.changed_by` and credential_departures says how it is read): the transaction that
-- changed a credential in a way that moves its pool's version, and a credential that left a pool.
-- A pool's departures older than ten minutes are dropped as new ones come (a service whose last
-- read of a pool is older than five minutes reads it whole), passing over rows another delete is
-- dropping at that moment: two deletes in one pool never wait for each other here.
CREATE OR REPLACE FUNCTION credentials_stamp_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.changed_by := pg_current_xact_id();
    RETURN NEW;
END;
$$;

DROP TRIGGER IF EXISTS credentials_stamp_insert ON credentials;
CREATE TRIGGER credentials_stamp_insert
    BEFORE INSERT ON credentials
    FOR EACH ROW EXECUTE FUNCTION credentials_stamp_change();

DROP TRIGGER IF EXISTS credentials_stamp_update ON credentials;
CREATE TRIGGER credentials_stamp_update
    BEFORE UPDATE ON credentials
    FOR EACH ROW
    WHEN (credentials_selection_moved(OLD, NEW))
    EXECUTE FUNCTION credentials_stamp_change();

CREATE OR REPLACE FUNCTION credentials_note_departure() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- (the provider named on both: on Citus the statement runs on the provider's worker alone)
    DELETE FROM credential_departures d
    WHERE d.provider = OLD.provider AND d.pool = OLD.pool
      AND d.ctid = ANY (ARRAY(
        SELECT o.ctid FROM credential_departures o
        WHERE o.provider = OLD.provider AND o.pool = OLD.pool
          AND o.departed_at < now() - interval '10 minutes'
        FOR UPDATE SKIP LOCKED));
    INSERT INTO credential_departures (provider, pool, key_id)
    VALUES (OLD.provider, OLD.pool, OLD.key_id);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS credentials_departed ON credentials;
CREATE TRIGGER credentials_departed
    AFTER DELETE ON credentials
    FOR EACH ROW EXECUTE FUNCTION credentials_note_departure();

DROP TRIGGER IF EXISTS credentials_moved ON credentials;
CREATE TRIGGER credentials_moved
    AFTER UPDATE ON credentials
    FOR EACH ROW
    WHEN ((OLD.provider, OLD.pool) IS DISTINCT FROM (NEW.provider, NEW.pool))
    EXECUTE FUNCTION credentials_note_departure();

-- Notifications for waiting allocations (`wait_ms`). Each service process LISTENs on one
-- connection; channel names and payloads are documented in docs/executor-protocol.md.
--   credpool_slot_freed   {"provider","pool","key_id","from"}: a slot's lease was released: sent
--                         by the releasing service process itself, after its commit, for the
--                         pools where some request waits (credpool_announce_freed: a NOTIFY takes
--                         a database-wide lock from its transaction's commit until the commit is
--                         flushed, so release transactions that notified would commit one at a
--                         time instead of sharing a WAL flush); {"provider","pool","key_id","slot"}
--                         from an operator's forced release, at its commit.
--   credpool_pool_changed {"provider","pool"}: the pool's version moved: every waiter of the
--                         pool looks again.
-- A lease that expires while nothing frees its slot sends nothing at that moment (nor does the
-- reaper or a refit that ends it): waiters know when each lease and each cooldown ends and set
-- their own timers for it.
DROP TRIGGER IF EXISTS lease_slots_freed ON lease_slots;
DROP FUNCTION IF EXISTS lease_slots_notify_freed();

-- Sends the announcements of slots freed by a service process's committed releases, one
-- notification each, on credpool_slot_freed. Its transaction holds nothing that needs to be
-- durable (notifications never are), so it does not wait for a WAL flush while it holds the
-- notification lock (synchronous_commit off, for this transaction only).
CREATE OR REPLACE FUNCTION credpool_announce_freed(p_announcements text[]) RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_notify('credpool_slot_freed', a) FROM unnest(p_announcements) AS a;
    RETURN coalesce(cardinality(p_announcements), 0);
END;
$$;

CREATE OR REPLACE FUNCTION pool_versions_notify_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('credpool_pool_changed', json_build_object(
        'provider', NEW.provider, 'pool', NEW.pool)::text);
    RETURN NULL;
END;
$$;

-- Whether table `p_table` is distributed by Citus (`credpool citus distribute`); false on plain
-- PostgreSQL. (Read with EXECUTE: without Citus, the catalog table is not there to be named.)
CREATE OR REPLACE FUNCTION credpool_is_distributed(p_table regclass)
RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_distributed boolean := false;
BEGIN
    IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition
                                WHERE logicalrelid = $1)'
        INTO v_distributed USING p_table;
    END IF;
    RETURN v_distributed;
END;
$$;

-- Not on Citus (pool_versions distributed: `credpool citus distribute`): a pool's version row is
-- on a worker, whose notifications never reach the coordinator's listeners, and PostgreSQL
-- refuses to prepare (commit on two nodes) a transaction that notified.
DROP TRIGGER IF EXISTS pool_versions_changed ON pool_versions;
DO $$
BEGIN
    IF NOT credpool_is_distributed('pool_versions') THEN
        CREATE TRIGGER pool_versions_changed
            AFTER INSERT OR UPDATE ON pool_versions
            FOR EACH ROW
            WHEN (NEW.backend <> 0)
            EXECUTE FUNCTION pool_versions_notify_changed();
    END IF;
END
$$;
