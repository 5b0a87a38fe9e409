-- Locks and gates: the pause point tests widen races with, the operator locks and the one
-- function that takes every lock an operator's change of credentials needs (LOCK), the tenant
-- slot rows of leases that end or renew, and the gate that makes a change of what a claim decides
-- on reach every slot row of the credential (GATES).
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one
-- transaction; every statement here must be safe to run again. Lock order and clocks:
-- docs/design.md ("Lock order", "Clocks").

-- A pause point for tests that widen a race window on purpose. Does nothing (returns true) unless
-- the setting credpool.test_hooks names `p_point`; then it waits for the shared advisory lock
-- of that point, which the test holds while it steps another transaction.
CREATE OR REPLACE FUNCTION credpool_test_hook(p_point text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF position(p_point IN coalesce(current_setting('credpool.test_hooks', true), '')) > 0 THEN
        PERFORM pg_advisory_xact_lock_shared(hashtextextended('credpool.test_hook:' || p_point, 0));
    END IF;
    RETURN true;
END;
$$;

-- The operator lock of key `p_key_id` (see LOCK): a transaction-scoped advisory lock key, one of
-- 64 buckets over the key ids.
CREATE OR REPLACE FUNCTION credpool_operator_lock(p_key_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('credpool.operator:' || (abs(hashtext(p_key_id)) % 64)::text, 0)
$$;

-- The keys (tenant_id, slot, lease_id) of the tenant_slots rows that hold the leases of slot
-- rows `p_slots` (a capped tenant's lease names its row on its slot row). The slot rows are read
-- field by field: Citus sends the statements that use this to a tenant's worker, and takes no
-- `unnest` of a table's rows there once the table has a dropped column.
CREATE OR REPLACE FUNCTION credpool_tenant_rows_of(p_slots lease_slots[])
RETURNS TABLE (tenant_id text, slot integer, lease_id uuid)
LANGUAGE sql IMMUTABLE AS $$
    SELECT (p_slots[i]).tenant, (p_slots[i]).tenant_slot, (p_slots[i]).lease_id
    FROM generate_subscripts(p_slots, 1) AS i
    WHERE (p_slots[i]).lease_id IS NOT NULL AND (p_slots[i]).tenant_slot IS NOT NULL
$$;

-- Locks the tenant_slots rows that hold the leases of slot rows `p_slots` (as the caller read
-- them, under their locks: each names its row, `tenant_slot`), ascending (tenant_id, slot), in one
-- statement per pass of tenants (credpool_slot_tenant_passes: one on plain PostgreSQL): lock
-- order 4, right after the slot rows. Leases of uncapped tenants (`default` among them) have no
-- such row (credpool_tenant_rows_of). Returns whether it locked any. PL/pgSQL with the settings
-- of END, so that its plan is made once per session and probes tenant_slots by its primary key
-- whoever calls first (an SQL function that locks rows cannot be inlined, and would be planned
-- again at every call).
CREATE OR REPLACE FUNCTION credpool_lock_tenant_slots(p_slots lease_slots[]) RETURNS boolean
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_tenant text;
    v_locked boolean := false;
BEGIN
    FOREACH v_tenant IN ARRAY credpool_slot_tenant_passes(p_slots) LOOP
        PERFORM 1
        FROM tenant_slots t
        WHERE credpool_on_tenant(t.tenant_id, v_tenant)
          AND (t.tenant_id, t.slot, t.lease_id) IN (
                  SELECT * FROM credpool_tenant_rows_of(p_slots))
        ORDER BY t.tenant_id, t.slot
        FOR UPDATE;
        v_locked := v_locked OR FOUND;
    END LOOP;
    RETURN v_locked;
END;
$$;

-- LOCK, for an operator's change of credentials `p_key_ids` (and for FIT), in the lock order:
--   * their operator locks (credpool_operator_lock), ascending: a credential that does not exist
--     yet has no row to lock, and two transactions creating the same key would otherwise meet
--     only at the INSERT, the second then writing slot rows after a credential row. Nobody waits
--     for one while holding a row lock (REFIT only tries it, before its rows); claims never take
--     one, releases only with an `auth_expired` report, before any row lock (RELEASE). 64
--     buckets keep a large import's advisory locks well within PostgreSQL's lock table;
--     operators' changes of two keys in one bucket wait for each other;
--   * then provider by provider, ascending (the providers of the credentials as they are once
--     the operator locks are held: every creation and deletion of a key takes its operator lock,
--     and a credential keeps its provider; and the providers of leases `p_lease_ids`), each in
--     statements that name that one provider (on Citus, each runs on the provider's worker):
--     every slot row of each credential, ascending (key_id, slot), including rows that a fit
--     which held them inserted while this call waited: a statement's snapshot does not see rows
--     committed after it started, so the rows are read again afterwards, and if any is not among
--     those locked the locks are given back (the block is a subtransaction: its row locks end
--     with it) and taken again, so that no slot row is ever locked after a credential row or out
--     of order; with them, in the same statement and order, the slot rows of leases
--     `p_lease_ids` of other credentials, held on credentials `p_lease_keys` (RELEASE: its
--     group's other leases, so that none of their rows is locked after a rejected credential's
--     rows that sort after it);
--   * the tenant_slots rows of their leases, their lease_windows rows, then (unless
--     p_credential_rows is false) the credential rows, FOR UPDATE, each kind in one statement
--     per provider, providers ascending.
--     Without the credential rows, the caller takes them itself later in the lock order: RELEASE
--     takes its late reports' lease locks (lock order 7) before it takes them.
-- Returns how many of the credentials exist.
DROP FUNCTION IF EXISTS credpool_lock_credentials(text[]);
DROP FUNCTION IF EXISTS credpool_lock_credentials(text[], boolean);
DROP FUNCTION IF EXISTS credpool_lock_credentials(text[], boolean, uuid[]);
CREATE OR REPLACE FUNCTION credpool_lock_credentials(p_key_ids text[],
    p_credential_rows boolean DEFAULT true, p_lease_ids uuid[] DEFAULT '{}',
    p_lease_keys text[] DEFAULT '{}')
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_providers text[];
    v_provider text;
    v_locked text[];
    v_present text[];
    v_tenant_slots lease_slots[] := '{}';
    -- every credential whose slot rows are locked: the rows are found by key (the slot rows have
    -- no index on lease_id; a search by lease alone would read the whole table)
    v_keys text[] := p_key_ids || p_lease_keys;
BEGIN
    PERFORM pg_advisory_xact_lock(b.bucket)
    FROM (SELECT DISTINCT credpool_operator_lock(k) AS bucket FROM unnest(p_key_ids) AS k) AS b
    ORDER BY b.bucket;
    v_providers := ARRAY(
        SELECT c.provider FROM credentials c WHERE c.key_id = ANY (p_key_ids)
        UNION
        SELECT s.provider FROM lease_slots s
        WHERE s.key_id = ANY (p_lease_keys) AND s.lease_id = ANY (p_lease_ids)
        ORDER BY 1);
    FOREACH v_provider IN ARRAY v_providers LOOP
        LOOP
            BEGIN
                SELECT coalesce(array_agg(format('%s/%s', l.key_id, l.slot) ORDER BY l.key_id, l.slot), '{}')
                INTO v_locked
                FROM (SELECT s.key_id, s.slot FROM lease_slots s
                      WHERE s.provider = v_provider AND s.key_id = ANY (v_keys)
                        AND (s.key_id = ANY (p_key_ids) OR s.lease_id = ANY (p_lease_ids))
                      ORDER BY s.key_id, s.slot
                      FOR UPDATE) AS l;
                SELECT coalesce(array_agg(format('%s/%s', s.key_id, s.slot) ORDER BY s.key_id, s.slot), '{}')
                INTO v_present
                FROM lease_slots s
                WHERE s.provider = v_provider AND s.key_id = ANY (v_keys)
                  AND (s.key_id = ANY (p_key_ids) OR s.lease_id = ANY (p_lease_ids));
                IF v_locked <> v_present THEN
                    RAISE EXCEPTION 'slot rows changed while they were locked' USING ERRCODE = 'CPL01';
                END IF;
                EXIT;
            EXCEPTION WHEN SQLSTATE 'CPL01' THEN
                NULL;
            END;
        END LOOP;
    END LOOP;
    -- the tenant slot rows of their leases (END clears them: FIT ends expired leases), in the
    -- lock order: after every slot row, before the windows and credential rows
    FOREACH v_provider IN ARRAY v_providers LOOP
        -- (the row rebuilt from its columns: on Citus a row read from a shard is of the shard's
        -- own type)
        SELECT v_tenant_slots || coalesce(array_agg(ROW(s.*)::lease_slots), '{}')
        INTO v_tenant_slots
        FROM lease_slots s
        WHERE s.provider = v_provider AND s.key_id = ANY (p_key_ids) AND s.lease_id IS NOT NULL;
    END LOOP;
    PERFORM credpool_lock_tenant_slots(v_tenant_slots);
    FOREACH v_provider IN ARRAY v_providers LOOP
        PERFORM 1 FROM lease_windows w
        WHERE w.provider = v_provider AND w.key_id = ANY (p_key_ids)
        ORDER BY w.key_id FOR UPDATE;
    END LOOP;
    IF p_credential_rows THEN
        FOREACH v_provider IN ARRAY v_providers LOOP
            PERFORM 1 FROM credentials c
            WHERE c.provider = v_provider AND c.key_id = ANY (p_key_ids)
            ORDER BY c.key_id FOR UPDATE;
        END LOOP;
    END IF;
    RETURN (SELECT count(*)::integer FROM credentials c WHERE c.key_id = ANY (p_key_ids));
END;
$$;

-- GATES: a change of what a claim decides on (see CLAIM) moves the credential's configuration
-- version, and writes it into every slot row of the credential in the same transaction. Health
-- written from outcome reports (credpool_release_health) does not: it holds a slot row and then
-- the credential row, and writing the other slot rows after the credential row would break the
-- lock order; the claim reads health from its snapshot by design. Such a write is told apart by
-- its row: it always moves health_decayed_at (credpool_health_apply decays the counts to the
-- report's clock), which nothing else writes; a change of status or cooldown that leaves
-- health_decayed_at as it was is an operator's (or the cleanup pass's). (The row, not a session
-- setting: on Citus the trigger fires on the worker, in a session of its own.) Every other
-- writer of credentials locks the slot rows first (credpool_lock_credentials), so the slot
-- update below never waits.
CREATE OR REPLACE FUNCTION credentials_config_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_WHEN = 'BEFORE' THEN
        NEW.config_version := OLD.config_version + 1;
        RETURN NEW;
    END IF;
    PERFORM credpool_test_hook('config.before_slots');
    UPDATE lease_slots s SET config_version = NEW.config_version
    WHERE s.provider = NEW.provider AND s.key_id = NEW.key_id
      AND s.config_version <> NEW.config_version;
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS credentials_config_version ON credentials;
CREATE TRIGGER credentials_config_version
    BEFORE UPDATE ON credentials
    FOR EACH ROW
    WHEN ((OLD.provider, OLD.pool, OLD.models, OLD.model_aliases, OLD.max_concurrent_uses,
           OLD.draining, OLD.rate_limits, OLD.secret, OLD.secret_ciphertext, OLD.token_expires_at)
          IS DISTINCT FROM
          (NEW.provider, NEW.pool, NEW.models, NEW.model_aliases, NEW.max_concurrent_uses,
           NEW.draining, NEW.rate_limits, NEW.secret, NEW.secret_ciphertext, NEW.token_expires_at)
          OR ((OLD.status, OLD.cooldown_until) IS DISTINCT FROM (NEW.status, NEW.cooldown_until)
              AND OLD.health_decayed_at IS NOT DISTINCT FROM NEW.health_decayed_at))
    EXECUTE FUNCTION credentials_config_changed();

DROP TRIGGER IF EXISTS credentials_config_to_slots ON credentials;
CREATE TRIGGER credentials_config_to_slots
    AFTER UPDATE ON credentials
    FOR EACH ROW
    WHEN (OLD.config_version IS DISTINCT FROM NEW.config_version)
    EXECUTE FUNCTION credentials_config_changed();
