-- Lease state: every transition of a lease, each defined once, with the invariant it keeps.
--
-- Repeatable: the one current definition of each object below. credpool applies this file after
-- the versioned migrations whenever its content changes (service/src/store/schema.rs), in one transaction;
-- every statement here must be safe to run again. `git log -p sql/lease.sql` is the history of
-- the claim.
--
-- The tables (versioned migrations): `credentials` (configuration and health), `lease_slots` (one
-- row per concurrency slot; a lease lives inside the slot row that holds it), `tenant_slots` (one
-- row per unit of a capped tenant's cap; a lease of a capped tenant lives in one of them too),
-- `lease_requests` (request ids), `lease_events` (the append-only trail).
--
-- Transitions, and which function is the one way to make each:
--   claim         credpool_claim          a free slot gets a lease (or a request replays its own)
--   renew         credpool_renew          a live lease gets a later lease_until
--   end           credpool_end_leases     leases leave their slots, with their trail rows: released,
--                                         expired (release, reaper, refit) or force_released
--   release       credpool_release        the executor's release: end, or tell why not
--   health        credpool_write_health   outcome reports applied to credentials (the state
--                                         machine itself is pure Rust, service/src/allocator/health.rs)
--   fit           credpool_fit_slots      a credential's slot rows brought in line with its limit
--                                         and drain state
--   force release credpool_force_release  an operator ends leases
--   reap          credpool_reap_expired_leases, credpool_refit_over_limit   cleanup passes
--   lock          credpool_lock_credentials   every lock an operator's change of a credential needs
--   fit tenant    credpool_fit_tenant     a tenant's slot rows brought in line with its cap (a
--                                         lease it adopts names its row: tenant_slot)
--   gate          trigger credentials_config_version: a change of what a claim decides on reaches
--                 every slot row of the credential (config_version)
-- Nothing else writes lease_slots.
--
-- Lock order (docs/design.md, "Lock order", says why no cycle can form). A transaction takes its
-- locks in this order, each kind in ONE statement, sorted:
--   0. operator locks (advisory, one per bucket of key ids, ascending; credpool_lock_credentials),
--      before any row lock: an operator's change of credentials, and a release group with an
--      `auth_expired` report (RELEASE); claims never take one, the cleanup pass's refit only
--      tries it.
--   0b. a tenant's advisory lock, then its `tenants` row (credpool_fit_tenant, an operator's PUT
--      or DELETE of the tenant: one change of a tenant's rows at a time). Claims take the
--      advisory lock in shared mode with a try-lock (never waiting), and not the row; a release
--      group reporting usage takes its leases' tenants' in shared mode, ascending, before its
--      operator locks (no transaction takes an operator lock before a tenant's).
--   1. lease_slots rows, ascending (key_id, slot). Claims take theirs with SKIP LOCKED and never
--      wait. A change of a credential takes every slot row of it (credpool_lock_credentials), and
--      so does a release group with an `auth_expired` report (RELEASE).
--   1b. tenant_slots rows, ascending (tenant_id, slot): the rows of the leases a transaction ends
--      or renews, right after those leases' slot rows (credpool_lock_tenant_slots: RELEASE,
--      RENEW, END, credpool_lock_credentials); a claim takes one with SKIP LOCKED, with its slot
--      row; credpool_fit_tenant takes every row of a tenant (after the slot rows of leases it
--      adopts).
--   2. lease_windows rows, ascending key_id (claims: SKIP LOCKED, with their slot row).
--   2b. tenant_windows rows, ascending tenant_id (claims: SKIP LOCKED; RELEASE, for the tenants
--      of leases released with a usage; credpool_fit_tenant, after the tenant's slot rows).
--   3. lease_events rows that unique indexes guard (one release / one late report per lease),
--      ascending lease_id (a release group writes its late reports in that order).
--   4. credentials rows, ascending key_id.
--   5. affinity_bindings rows: claims write them last, only rows they locked with SKIP LOCKED or
--      that do not exist, under their affinity keys' advisory try-locks (CLAIM, "AFFINITY"), so
--      they never wait; a credential's delete removes its bindings by cascade, after its row.
--   6. oauth_credentials rows, ascending key_id (the OAuth refresher, service/src/oauth.rs, and
--      an operator's PUT; the refresher's marker takes this row alone, in its own transaction).
-- pool_versions rows are per backend and never contended; lease_requests rows are written only
-- under their request_id's advisory lock, taken with a try-lock.
--
-- Clocks. A decision is made on the database clock, and on one reading of it: the claim and the
-- reaper never wait for a lock, so they decide on statement_timestamp(); a transition that may
-- wait for a row lock reads clock_timestamp() after its locks are taken (now() and
-- statement_timestamp() are stale after a wait).

-- DESIGN "Vocabulary": status says health only. `available` is usable; `rate_limited`, `cooldown`
-- and `exhausted` are usable once cooldown_until has passed (opportunistic recovery) and not
-- usable with an unknown cooldown_until; `pending` and `disabled` are not usable. `at` is the
-- decision clock of the caller.
CREATE OR REPLACE FUNCTION credential_usable(status text, cooldown_until timestamptz, at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT status = 'available'
        OR (status IN ('rate_limited', 'cooldown', 'exhausted')
            AND cooldown_until IS NOT NULL
            AND cooldown_until <= at)
$$;

-- When a credential that is not usable at `at` becomes usable on its own: the end of its cooldown;
-- NULL when it is usable now or needs an operator. Same rule as credential_usable.
CREATE OR REPLACE FUNCTION credential_recovers_at(status text, cooldown_until timestamptz, at timestamptz)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN status IN ('rate_limited', 'cooldown', 'exhausted') AND cooldown_until > at THEN cooldown_until
    END
$$;

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

-- Locks the tenant_slots rows that hold the leases of slot rows `p_slots` (as the caller read
-- them, under their locks: each names its row, `tenant_slot`), ascending (tenant_id, slot), in one
-- statement: lock order 1b, right after the slot rows. Leases of uncapped tenants (`default`
-- among them) have no such row. Returns
-- whether it locked any. PL/pgSQL with the settings of END, so that its plan is made once per
-- session and probes tenant_slots by its primary key whoever calls first (an SQL function that
-- locks rows cannot be inlined, and would be planned again at every call).
CREATE OR REPLACE FUNCTION credpool_lock_tenant_slots(p_slots lease_slots[]) RETURNS boolean
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    PERFORM 1
    FROM tenant_slots t
    WHERE (t.tenant_id, t.slot, t.lease_id) IN (
              SELECT x.tenant, x.tenant_slot, x.lease_id FROM unnest(p_slots) AS x
              WHERE x.lease_id IS NOT NULL AND x.tenant_slot IS NOT NULL)
    ORDER BY t.tenant_id, t.slot
    FOR UPDATE;
    RETURN FOUND;
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
--   * every slot row of each, ascending (key_id, slot), including rows that a fit which held them
--     inserted while this call waited: a statement's snapshot does not see rows committed after
--     it started, so the rows are read again afterwards, and if any is not among those locked the
--     locks are given back (the block is a subtransaction: its row locks end with it) and taken
--     again, so that no slot row is ever locked after a credential row or out of order;
--   * the tenant_slots rows of their leases, their lease_windows rows, then (unless
--     p_credential_rows is false) the credential rows, FOR UPDATE, each kind in one statement.
--     Without the credential rows, the caller takes them itself later in the lock order: RELEASE
--     writes its trail rows (lock order 3) before it takes them.
-- Returns how many of the credentials exist.
DROP FUNCTION IF EXISTS credpool_lock_credentials(text[]);
CREATE OR REPLACE FUNCTION credpool_lock_credentials(p_key_ids text[],
    p_credential_rows boolean DEFAULT true)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_locked text[];
    v_present text[];
    v_found integer;
BEGIN
    PERFORM pg_advisory_xact_lock(b.bucket)
    FROM (SELECT DISTINCT credpool_operator_lock(k) AS bucket FROM unnest(p_key_ids) AS k) AS b
    ORDER BY b.bucket;
    LOOP
        BEGIN
            SELECT coalesce(array_agg(format('%s/%s', l.key_id, l.slot) ORDER BY l.key_id, l.slot), '{}')
            INTO v_locked
            FROM (SELECT s.key_id, s.slot FROM lease_slots s
                  WHERE s.key_id = ANY (p_key_ids)
                  ORDER BY s.key_id, s.slot
                  FOR UPDATE) AS l;
            SELECT coalesce(array_agg(format('%s/%s', s.key_id, s.slot) ORDER BY s.key_id, s.slot), '{}')
            INTO v_present
            FROM lease_slots s
            WHERE s.key_id = ANY (p_key_ids);
            IF v_locked <> v_present THEN
                RAISE EXCEPTION 'slot rows changed while they were locked' USING ERRCODE = 'CPL01';
            END IF;
            EXIT;
        EXCEPTION WHEN SQLSTATE 'CPL01' THEN
            NULL;
        END;
    END LOOP;
    -- the tenant slot rows of their leases (END clears them: FIT ends expired leases), in the
    -- lock order: after the slot rows, before the windows and credential rows
    PERFORM credpool_lock_tenant_slots(ARRAY(
        SELECT s FROM lease_slots s WHERE s.key_id = ANY (p_key_ids) AND s.lease_id IS NOT NULL));
    PERFORM 1 FROM lease_windows w WHERE w.key_id = ANY (p_key_ids) ORDER BY w.key_id FOR UPDATE;
    IF NOT p_credential_rows THEN
        SELECT count(*)::integer INTO v_found FROM credentials c WHERE c.key_id = ANY (p_key_ids);
        RETURN v_found;
    END IF;
    SELECT count(*)::integer INTO v_found
    FROM (SELECT 1 FROM credentials c WHERE c.key_id = ANY (p_key_ids) ORDER BY c.key_id FOR UPDATE) AS l;
    RETURN v_found;
END;
$$;

-- GATES: a change of what a claim decides on (see CLAIM) moves the credential's configuration
-- version, and writes it into every slot row of the credential in the same transaction. Health
-- written from outcome reports (credpool_write_health, which sets credpool.health_write for its
-- own run) does not: it holds a slot row and then the credential row, and writing the other slot
-- rows after the credential row would break the lock order; the claim reads health from its
-- snapshot by design. Every other writer of credentials locks the slot rows first
-- (credpool_lock_credentials), so the slot update below never waits.
CREATE OR REPLACE FUNCTION credentials_config_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_WHEN = 'BEFORE' THEN
        NEW.config_version := OLD.config_version + 1;
        RETURN NEW;
    END IF;
    PERFORM credpool_test_hook('config.before_slots');
    UPDATE lease_slots s SET config_version = NEW.config_version
    WHERE s.key_id = NEW.key_id AND s.config_version <> NEW.config_version;
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
              AND current_setting('credpool.health_write', true) IS DISTINCT FROM 'on'))
    EXECUTE FUNCTION credentials_config_changed();

DROP TRIGGER IF EXISTS credentials_config_to_slots ON credentials;
CREATE TRIGGER credentials_config_to_slots
    AFTER UPDATE ON credentials
    FOR EACH ROW
    WHEN (OLD.config_version IS DISTINCT FROM NEW.config_version)
    EXECUTE FUNCTION credentials_config_changed();

-- The trail rows of leases that end: element i of each array is the i-th lease's. `p_events[i]`
-- is released, expired or force_released; `p_at[i]` when it took effect (an expired lease's own
-- lease_until); `p_outcomes`, `p_reasons`, `p_actors`, `p_tokens` (the usage its release
-- reported) may be NULL as a whole. Writes lease_events only; the caller holds the slot rows'
-- locks.
DROP FUNCTION IF EXISTS credpool_record_lease_end(lease_slots, text, timestamptz, text, text, text, bigint);
CREATE OR REPLACE FUNCTION credpool_record_lease_ends(
    p_slots lease_slots[], p_events text[], p_at timestamptz[], p_outcomes text[] DEFAULT NULL,
    p_reasons text[] DEFAULT NULL, p_actors text[] DEFAULT NULL, p_tokens bigint[] DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lease_events
        (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at, reason,
         actor, tokens, tenant)
    SELECT p_events[i], (p_slots[i]).lease_id, (p_slots[i]).key_id, (p_slots[i]).provider,
           (p_slots[i]).pool, (p_slots[i]).slot, (p_slots[i]).holder, p_outcomes[i],
           (p_slots[i]).lease_until, p_at[i], p_reasons[i], p_actors[i], p_tokens[i],
           (p_slots[i]).tenant
    FROM generate_subscripts(p_slots, 1) AS i;
END;
$$;

-- END: the one way leases leave their slots, any number at once (element i of each array is the
-- i-th lease's: the slot row as the caller read it, and the trail row's values as for
-- credpool_record_lease_ends). Clears every lease column of each slot row (the slot keeps its
-- number, its last grant time and its gates) and writes the trail rows, in two statements
-- however many leases end. Only where the slot still holds that lease: ending twice ends once.
-- A row within a lowered limit (over_limit, not surplus) that frees while a surplus row of its
-- credential still holds a lease becomes surplus too: opened now, it would grant while the
-- surplus lease still counts (FIT says why rows within the limit may otherwise reopen on their
-- own). Such a row is over_limit, so the caller refits the credential (RELEASE's `refit`).
-- A lease of a capped tenant leaves its tenant slot row in the same call (the row's lock taken
-- here, after the slot rows, unless the caller took it right after them, as RELEASE and
-- credpool_lock_credentials do: a caller that holds a lease_windows or credentials row must have,
-- lock order 1b), so the tenant's cap frees with the credential's slot: a tenant slot row holds a
-- lease exactly while the lease's slot row does (or until both have expired). A tenant slot row
-- over a lowered cap (`over_limit`) stays closed: the caller refits the tenant
-- (credpool_fit_tenant, RELEASE's `tenant_refit`).
-- The caller has locked the slot rows (in the lock order) and decided, on its own clock, that the
-- leases end now. A freed slot announces itself (trigger lease_slots_freed). Returns the leases
-- it ended.
DROP FUNCTION IF EXISTS credpool_end_lease(lease_slots, text, timestamptz, text, text, text, bigint);
CREATE OR REPLACE FUNCTION credpool_end_leases(
    p_slots lease_slots[], p_events text[], p_at timestamptz[], p_outcomes text[] DEFAULT NULL,
    p_reasons text[] DEFAULT NULL, p_actors text[] DEFAULT NULL, p_tokens bigint[] DEFAULT NULL)
RETURNS uuid[]
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_ended integer[];
BEGIN
    WITH cleared AS (
        UPDATE lease_slots s
        SET lease_id = NULL, provider = NULL, pool = NULL, holder = NULL, granted_at = NULL,
            lease_until = NULL, probe = false, fence = NULL, reserved_tokens = NULL, tenant = NULL,
            tenant_slot = NULL,
            surplus = s.surplus
                      OR (s.over_limit
                          AND EXISTS (SELECT 1 FROM lease_slots o
                                      WHERE o.key_id = s.key_id AND o.surplus
                                        AND o.lease_id IS NOT NULL AND o.slot <> s.slot))
        FROM generate_subscripts(p_slots, 1) AS i
        WHERE s.key_id = (p_slots[i]).key_id AND s.slot = (p_slots[i]).slot
          AND s.lease_id = (p_slots[i]).lease_id
        RETURNING i
    )
    SELECT array_agg(i ORDER BY i) INTO v_ended FROM cleared;
    IF v_ended IS NULL THEN
        RETURN '{}';
    END IF;
    -- their tenant slot rows: locked in order (held already when the caller locked them after
    -- the slot rows), then cleared where they still hold the lease (a row whose expired lease a
    -- claim has replaced holds another lease now); leases of uncapped tenants, `default` among
    -- them, have no row: nothing more to do
    IF credpool_lock_tenant_slots(ARRAY(SELECT p_slots[i] FROM unnest(v_ended) AS i)) THEN
        UPDATE tenant_slots t
        SET lease_id = NULL, key_id = NULL, lease_until = NULL
        FROM unnest(v_ended) AS i
        WHERE t.tenant_id = (p_slots[i]).tenant AND t.slot = (p_slots[i]).tenant_slot
          AND t.lease_id = (p_slots[i]).lease_id;
    END IF;
    IF cardinality(v_ended) = cardinality(p_slots) THEN
        PERFORM credpool_record_lease_ends(p_slots, p_events, p_at, p_outcomes, p_reasons,
                                           p_actors, p_tokens);
    ELSE
        PERFORM credpool_record_lease_ends(
            ARRAY(SELECT p_slots[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_events[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_at[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_outcomes[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_reasons[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_actors[i] FROM unnest(v_ended) AS i),
            ARRAY(SELECT p_tokens[i] FROM unnest(v_ended) AS i));
    END IF;
    RETURN ARRAY(SELECT (p_slots[i]).lease_id FROM unnest(v_ended) AS i);
END;
$$;

-- Whether credential `c` may serve a claim for (provider, pool, model) at `p_at`: it is in the
-- pool, serves the model (directly or through an alias), is usable and is not drained.
CREATE OR REPLACE FUNCTION credpool_may_serve(
    c credentials, p_provider text, p_pool text, p_model text, p_at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT c.provider = p_provider
       AND c.pool = p_pool
       AND (p_model = ANY (c.models) OR c.model_aliases ? p_model)
       AND credential_usable(c.status, c.cooldown_until, p_at)
       AND NOT c.draining
$$;

-- Whether credential `c`'s access token is still valid at `p_until` (the end of the lease a
-- claim would grant): always for a credential that is not OAuth (token_expires_at NULL). An OAuth
-- credential whose token would expire first is passed over until its refresh lands (issue 28).
CREATE OR REPLACE FUNCTION credpool_token_lasts(c credentials, p_until timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT c.token_expires_at IS NULL OR c.token_expires_at >= p_until
$$;

-- When credential `c`'s access token may last a lease that ends at `p_until`, judged at `p_at`:
-- `p_at` when it lasts already (or the credential is not OAuth); otherwise when its refresh is
-- expected to have landed: the refresh starts `refresh_before_seconds` before the token expires
-- (or when a failed attempt's backoff ends, or at once when it is due), and a token call takes
-- about a second. For the Retry-After of a claim that passed over the credential: the refresh,
-- not a slot, is what it waits for (`held_by` 'token_refresh'). A token a report rejected
-- (`auth_expired`, RELEASE) counts as expired, so it is due at once.
CREATE OR REPLACE FUNCTION credpool_token_refreshed_at(c credentials, p_until timestamptz,
    p_at timestamptz)
RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN credpool_token_lasts(c, p_until) THEN p_at
        ELSE (SELECT greatest(p_at + interval '1 second', o.next_attempt_at,
                              c.token_expires_at - make_interval(secs => o.refresh_before_seconds))
              FROM oauth_credentials o
              WHERE o.key_id = c.key_id)
    END
$$;

-- Whether slot `s` of a credential whose status is `p_status` is free for a claim at `p_at`: its
-- lease slot is empty or its lease has expired, and its gates are open (not a surplus row of a
-- lowered limit, not draining). A credential back from a cooldown (usable, status not yet
-- `available`) is half-open: only its slot 0 can be claimed, so it serves a single probe lease
-- at a time.
CREATE OR REPLACE FUNCTION credpool_slot_open(s lease_slots, p_status text, p_at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (p_status = 'available' OR s.slot = 0)
       AND NOT s.surplus
       AND NOT s.draining
       AND (s.lease_id IS NULL OR s.lease_until <= p_at)
$$;

-- Whether tenant slot row `t` is free for a claim at `p_at` (CLAIM, "Tenants"): it holds no lease
-- or its lease has expired, and it is not over a lowered cap (`over_limit`, see FIT TENANT). The
-- tenant's counterpart of credpool_slot_open; an SQL function that inlines into the statement.
CREATE OR REPLACE FUNCTION credpool_tenant_slot_open(t tenant_slots, p_at timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT NOT t.over_limit AND (t.lease_id IS NULL OR t.lease_until <= p_at)
$$;

-- When credential `c` (its windows `w`, or NULL) may next serve a claim reserving `p_tokens`,
-- judged at `p_at`: `at`, the latest of the end of its cooldown, the moment one of its slots
-- frees, and the moment its windows admit the claim (`p_at` when it may serve now; NULL when
-- nothing known ends: it waits for an operator, is over a lowered limit or draining, or a window
-- can never hold the reservation), and `held_by`, which of those it is: 'slots', 'cooldown',
-- 'requests_window' or 'tokens_window'. For the Retry-After of a claim that granted nothing.
DROP FUNCTION IF EXISTS credpool_frees_at(credentials, lease_windows, bigint, timestamptz);
CREATE FUNCTION credpool_frees_at(c credentials, w lease_windows, p_tokens bigint, p_at timestamptz,
    OUT at timestamptz, OUT held_by text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_usable timestamptz;
    v_slot timestamptz;
    v_window timestamptz := p_at;
BEGIN
    v_usable := CASE WHEN credential_usable(c.status, c.cooldown_until, p_at) THEN p_at
                     ELSE credential_recovers_at(c.status, c.cooldown_until, p_at) END;
    IF v_usable IS NULL THEN
        RETURN;
    END IF;
    SELECT CASE WHEN bool_or(credpool_slot_open(s, c.status, greatest(p_at, v_usable))) THEN p_at
                ELSE min(s.lease_until) FILTER (
                         WHERE s.lease_until > p_at AND NOT s.surplus AND NOT s.draining
                           AND (c.status = 'available' OR s.slot = 0)) END
    INTO v_slot
    FROM lease_slots s
    WHERE s.key_id = c.key_id;
    IF v_slot IS NULL THEN
        RETURN;
    END IF;
    IF w.key_id IS NOT NULL THEN
        v_window := nullif(credpool_window_frees_at(w, p_at, p_tokens), 'infinity');
        IF v_window IS NULL THEN
            RETURN;
        END IF;
    END IF;
    at := greatest(v_usable, v_slot, v_window);
    held_by := CASE
        WHEN v_window = at AND v_window > p_at THEN credpool_window_holding(w, p_at, p_tokens) || '_window'
        WHEN v_usable = at AND v_usable > p_at THEN 'cooldown'
        ELSE 'slots' END;
END;
$$;

-- AFFINITY (issue 30): a grant's affinity result, for a claim that named `p_affinity_key`, whose
-- live binding was `p_bound` (NULL: none), served by `p_key_id`: 'hit' (the bound credential
-- served), 'moved' (another one did), 'new' (there was no live binding); NULL without an
-- affinity key.
CREATE OR REPLACE FUNCTION credpool_affinity_result(p_affinity_key text, p_bound text, p_key_id text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN p_affinity_key IS NULL THEN NULL
                WHEN p_bound = p_key_id THEN 'hit'
                WHEN p_bound IS NOT NULL THEN 'moved'
                ELSE 'new' END
$$;

-- AFFINITY: the advisory lock of one binding's key (transaction-scoped, only ever tried): held by
-- the claim that writes the binding and by the maintenance pass that deletes it, so neither ever
-- meets a row the other is writing.
CREATE OR REPLACE FUNCTION credpool_affinity_lock(p_tenant text, p_provider text, p_pool text,
    p_affinity_key text)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended(
        'credpool.affinity:' || p_tenant || '/' || p_provider || '/' || p_pool || '/' || p_affinity_key, 0)
$$;

-- FAIR SHARE (issue 29; docs/design.md "Fair share"): the tenant a waiting claim yields to, or
-- NULL. A claim of an allocation that waits (wait_ms) for a slot of p_pool, for p_model, made for
-- p_tenant whose request arrived at p_since, yields when another tenant waits for the same
-- provider, pool and model (a live pool_waiters row: its wait not over, its process alive within
-- the last 5 seconds) and stands further below its weighted share of the pool: its live leases in
-- the pool with the one it would get, divided by its weight, are fewer than the claim's tenant's
-- (ties: the tenant whose earliest waiter arrived first). Counting the lease to come is weighted
-- fair queuing's order (the next grant goes to the earliest virtual finish); it keeps the same
-- split (2:4:2 of 8 slots for weights 1:2:1) and, unlike leases / weight alone, leaves no tie
-- between tenants of unequal weights at that split, where a claim that read just before a release
-- committed would win the tie and take the releasing tenant's slot (measured: the tenant of
-- weight 2 got 45.5% of the grants instead of 50%). A tenant at its own cap (no free tenant
-- slot row) cannot take the slot and is not yielded to, so no slot is ever held back for a
-- tenant that cannot use it. Read from
-- the claim's snapshot: a share is a preference between waiters, not a limit (nothing over any
-- limit can come of a stale read; two claims of one freed slot settle it on the slot row).
-- p_pending: the tenants of the claims of the same call, for the same pool, that went ahead
-- before this one (one entry per claim): counted as in flight, since the call's claims do not
-- see each other's grants (without it, every claim of a tenant one below its share would go
-- ahead in one call).
-- Costs one probe of pool_waiters; when another tenant waits, one read of the pool's live slot
-- rows (lease_slots has no index on the tenant: it would cost the hot updates of every grant).
DROP FUNCTION IF EXISTS credpool_fair_share_ahead(text, text, text, text, timestamptz, timestamptz);
CREATE OR REPLACE FUNCTION credpool_fair_share_ahead(p_provider text, p_pool text, p_model text,
    p_tenant text, p_since timestamptz, p_pending text[], p_now timestamptz)
RETURNS text
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_waiting text[];
    v_since timestamptz[];
    v_ahead text;
BEGIN
    SELECT array_agg(w.tenant ORDER BY w.tenant), array_agg(w.since ORDER BY w.tenant)
    INTO v_waiting, v_since
    FROM (
        SELECT w.tenant, min(w.since) AS since
        FROM pool_waiters w
        JOIN pool_waiter_processes p ON p.instance = w.instance
        WHERE w.provider = p_provider AND w.model = p_model AND p_pool = ANY (w.pools)
          AND w.until > p_now AND p.seen_at > p_now - interval '5 seconds'
          AND w.tenant <> p_tenant
        GROUP BY w.tenant
    ) AS w;
    IF v_waiting IS NULL THEN
        RETURN NULL;
    END IF;
    WITH counted AS (
        SELECT l.tenant, count(*) AS in_flight
        FROM (SELECT s.tenant
              FROM credentials c
              JOIN lease_slots s ON s.key_id = c.key_id
              WHERE c.provider = p_provider AND c.pool = p_pool AND s.lease_until > p_now
                AND (s.tenant = p_tenant OR s.tenant = ANY (v_waiting))
              UNION ALL
              SELECT u.tenant FROM unnest(p_pending) AS u (tenant)) AS l
        GROUP BY l.tenant
    ),
    shares AS (
        SELECT x.tenant, x.since, (coalesce(n.in_flight, 0) + 1)::numeric / t.weight AS share,
               t.max_concurrent_leases IS NULL
               OR EXISTS (SELECT 1 FROM tenant_slots ts
                          WHERE ts.tenant_id = t.tenant_id
                            AND credpool_tenant_slot_open(ts, p_now)) AS has_room
        FROM unnest(v_waiting, v_since) AS x (tenant, since)
        JOIN tenants t ON t.tenant_id = x.tenant
        LEFT JOIN counted n ON n.tenant = x.tenant
    ),
    mine AS (
        SELECT (coalesce((SELECT n.in_flight FROM counted n WHERE n.tenant = p_tenant), 0) + 1)::numeric
               / t.weight AS share
        FROM tenants t
        WHERE t.tenant_id = p_tenant
    )
    SELECT s.tenant INTO v_ahead
    FROM shares s, mine m
    WHERE s.has_room AND (s.share < m.share OR (s.share = m.share AND s.since < p_since))
    ORDER BY s.share, s.since
    LIMIT 1;
    RETURN v_ahead;
END;
$$;

-- FAIR SHARE: a process with waiting requests says it is alive (every second while it has any),
-- and deletes the rows of waiters whose process stopped saying so a minute ago or whose wait
-- ended a minute ago (a row a claim is writing is skipped, never waited for).
CREATE OR REPLACE FUNCTION credpool_waiters_seen(p_instance text)
RETURNS void
LANGUAGE sql
AS $$
    INSERT INTO pool_waiter_processes (instance, seen_at) VALUES (p_instance, now())
    ON CONFLICT (instance) DO UPDATE SET seen_at = EXCLUDED.seen_at;
    DELETE FROM pool_waiters
    WHERE waiter IN (SELECT w.waiter FROM pool_waiters w
                     LEFT JOIN pool_waiter_processes p ON p.instance = w.instance
                     WHERE w.until < now() - interval '1 minute'
                        OR coalesce(p.seen_at < now() - interval '1 minute', true)
                     FOR UPDATE OF w SKIP LOCKED);
    DELETE FROM pool_waiter_processes WHERE seen_at < now() - interval '1 minute';
$$;

-- The tenant of the executor key whose hash (hex SHA-256) is `p_key_hash`: one row, the key's
-- tenant, while the key is live; no row for a key that is unknown or revoked. NULL: the configured
-- internal key, whose tenant is `default`. Read by the statement that decides, so a call that
-- starts after a revoke committed is refused on every replica. A set-returning SQL function, so
-- that it inlines where it is joined (`LEFT JOIN LATERAL credpool_key_tenant(...) ON true`): one
-- probe of tenant_keys' unique key_hash index.
CREATE OR REPLACE FUNCTION credpool_key_tenant(p_key_hash text)
RETURNS SETOF text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT 'default'::text WHERE p_key_hash IS NULL
    UNION ALL
    SELECT k.tenant_id FROM tenant_keys k
    WHERE k.key_hash = decode(p_key_hash, 'hex') AND k.revoked_at IS NULL
$$;

-- CLAIM (DESIGN "The protocol", step 1), for one request or for a group.
--
-- p_claims jsonb: an array of claims, each {"ranked": [key_id, ...] (best first, the Rust
-- scoring), "provider", "pool", "model" (a model or alias), "lease_id" (the new lease's uuid),
-- "holder" (or null), "lease_seconds", "tokens" (the reservation for token windows; 0 or absent:
-- none), optionally "request_id" with "request_digest", "key_hash" (hex SHA-256 of the
-- executor key presented; absent: the configured internal key, tenant `default`), optionally
-- "waiting" (the request waits for a slot: {"waiter" (uuid, the request's), "instance" (its
-- process), "pools" (its pool sequence), "since" and "until" (RFC 3339: its arrival, the end of
-- its wait)}; FAIR SHARE, below), and
-- optionally the AFFINITY fields (below)}. Returns one row per claim, `claim` =
-- its 1-based position: the pool's version (NULL when the pool never had a credential), read
-- before any candidate, so the caller learns whether its candidate view is stale, and the lease,
-- NULL when no candidate could serve. `request` is NULL, 'replayed' (the request_id's live lease,
-- granted to an earlier attempt with the same parameters: no slot taken), 'conflict' (its live
-- lease was granted for other parameters), 'in_flight' (another transaction is claiming for the
-- same request_id right now) or 'busy' (nothing granted, but a candidate that may serve at once,
-- read after the claim, was held by another transaction or changed by one at that moment): for
-- the last two, claim again in a moment; 'unauthorized' (its key_hash names no live key: nothing
-- done) or 'tenant_limit' (nothing granted: every slot row of its tenant holds a live lease, or a
-- window of its tenant has no room, read after the claim) or 'yield' (nothing looked at: a waiting claim whose pool another tenant, further
-- below its share, waits for; `yield_to` names that tenant). `frees_at`, when nothing was granted: the earliest moment a candidate may
-- serve it (for 'tenant_limit': the earliest end of the tenant's leases, or when its windows
-- have room), and `held_by` what holds that candidate back (credpool_frees_at; 'tenant',
-- 'tenant_window'), for the answer's Retry-After, a
-- waiting request's timer and the held-back metric. `tenant` is the tenant the claim was made
-- for, `db_now` the call's clock.
--
-- AFFINITY (issue 30; docs/design.md "Affinity"). A claim may name "affinity_key" (a conversation
-- id), "affinity_pools" (the pool sequence of the pool asked for, that pool first: the binding's
-- pool), "affinity_ttl_seconds" and "affinity_mode" ('preferred' or 'strict'). Its live binding
-- (affinity_bindings, expires_at after the call's clock) is read once, after the parse, and its
-- credential put first in the claim's ranked list (and taken out of the rest of it): PICK tries
-- it first, under every gate of the locked row like any candidate, and passes over it when it
-- cannot serve now (full, its windows full, disabled, drained, cooling down, in another pool,
-- its token expiring), so the claim is served by the next candidate in the same round: a binding
-- is a preference, never a wait. `strict`: while the bound credential could serve but for its
-- slots and windows, the claim considers it alone (in the pool of the sequence it is in; the
-- other pools' claims rank nothing) and answers `affinity` 'bound' when it granted nothing, so
-- the caller waits for that credential (or answers 429); when it could not serve at all, strict
-- is preferred. The answer's `affinity`, for a grant (not a replay): 'hit' (the bound credential
-- served), 'moved' (a live binding existed, another credential served) or 'new' (no live
-- binding); the `granted` trail row carries it too. After the rounds, ONE statement writes the
-- bindings of the call's grants (a hit refreshes last_hit_at and expires_at; new and moved bind
-- the credential that served), each only if this call got its affinity key's advisory lock with
-- a try-lock, and only where the binding's row, if it exists, could be locked with SKIP LOCKED:
-- a binding this call cannot write is left as it is (it is a hint), so the write never waits.
-- Nothing granted: no binding is written. Bindings are per tenant: a conversation key of one
-- tenant never reads or moves another tenant's binding.
--
-- A group of claims is one call: one round trip and, outside an explicit transaction, one commit.
-- Its claims are decided together, in rounds, each round two statements whatever the number of
-- claims (and one more for each thing only some winners need: ending the expired leases their
-- slots carry, charging windows, request ids' rows, probes' trail rows). PICK takes, for every
-- claim still open, the first candidate in its own ranked order that may serve it
-- (credpool_may_serve), whose token (OAuth) lasts the lease (credpool_token_lasts), and that has
-- a free slot (credpool_slot_open) and, if it has rate windows, room in every window
-- (credpool_window_room, sql/windows.sql), and locks that slot row (and the credential's
-- lease_windows row); of the claims that picked one credential, the first in array order wins
-- it, the others are open again in the next round. GRANT then begins the
-- winners' leases (the expired lease a slot still carries ended in the trail, the lease in the
-- slot, the windows charged, the request_id's row, the `granted` trail row, `probe_granted` for a
-- probe). Each round is a new statement, so it sees the grants of the rounds before it (and what
-- other transactions committed meanwhile); a credential is granted at most once per round, so
-- every grant and every window charge is decided on the slot and window rows as the grants before
-- it left them: the same as claiming one after the other, in array order, at a fraction of the
-- statements. A claim that picked nothing is not granted. Every round grants at least one claim,
-- so there are at most as many rounds as claims, and in practice one or two.
--
-- Why this cannot oversell: capacity is not counted, it is the set of slot rows, and a lease
-- exists only inside the slot row that holds it. Every condition that decides whether a grant may
-- happen is on a row PICK locks: whether the slot is free, whether its credential is over a
-- lowered limit, draining or has rate windows (credpool_fit_slots writes those gates into every
-- slot row under the rows' locks), and how much room its windows have (its lease_windows row).
-- Under READ COMMITTED, when FOR UPDATE meets a row that another transaction changed after this
-- statement's snapshot, PostgreSQL re-evaluates the WHERE clause against the newest version of the
-- locked rows (EvalPlanQual): a slot that a concurrent claim has just filled, a window a concurrent
-- claim has just charged, a slot a refit has just closed, no longer passes and is passed over.
-- SKIP LOCKED passes over rows another transaction holds right now, so concurrent claims spread
-- over the free slots instead of queueing. Two transactions can never both hold one slot row's
-- lock, so each slot carries at most one unexpired lease; nor one lease_windows row's, so each
-- window charge sees every charge before it. (The trap in DESIGN — lock the credential, count its
-- leases in a subquery — fails because the count reads the statement's snapshot, which
-- EvalPlanQual does not refresh for rows other than the locked ones.) Within one PICK, the claims
-- of this call do not see each other (one snapshot, and a transaction's own locks do not make it
-- skip a row): two of them may pick the same slot, which is why only one claim per credential
-- wins a round.
--
-- The credential row is read from the snapshot, not locked (locking it would make every claim on
-- a credential queue on one row). What the claim decides on it — provider, pool, models and
-- aliases, the secret it hands out, an operator's status — is gated through the slot row: every
-- change of those moves credentials.config_version and, in the same transaction, writes the new
-- version into every slot row of the credential (trigger credentials_config_version, above). The
-- claim grants only where `s.config_version = c.config_version`. A change committed after the
-- claim's snapshot and before its lock changed the slot row, so EvalPlanQual re-checks it: the
-- locked row's new version against the snapshot's old credential row, unequal, and the candidate
-- is passed over (the caller claims again and reads the new configuration). A change still in
-- progress holds the slot rows (operators lock all of them first), so SKIP LOCKED passes over
-- them; a change that starts after the lock waits for this claim's commit, and the grant comes
-- before it. Only health written from outcome reports (a cooldown, a status an outcome sets) is
-- read from the snapshot without a gate: a report committed while the claim runs may let this one
-- grant through, never a grant over a limit or a window.
--
-- OAuth (issue 28): a credential whose access token expires before the lease would end
-- (credentials.token_expires_at < the call's clock + lease_seconds) is passed over, and its
-- `frees_at` is when its refresh should land (credpool_token_refreshed_at; it waits for its
-- refresh, not for a slot, so the caller does not claim it again at once). The expiry is a column of the credential row, read from the snapshot like the secret it
-- belongs to, and gated the same way: a refresh writes a new secret and expiry together, which
-- moves config_version into every slot row. A winner's lease_until is never later than its
-- token's expiry: `at` (read when the slot row is read) may be a little after the call's clock,
-- so the grant takes the earlier of the two.
--
-- Tenants (issue 29): the key_hash names the tenant (a revoked key names none: read by the call's
-- first statement, so a request that starts after the revoke committed is refused on every
-- replica). That statement also tries the tenant's advisory lock in shared mode, which every
-- change of the tenant (an operator's PUT or DELETE, a fit) takes exclusively: held, no change of
-- the tenant commits until this call has, so PICK, a later statement with a later snapshot, reads
-- the tenant's cap and windows as they will stay until the grant commits, and a change waits
-- for the grant and counts it (a cap adopts its lease, a new window seeds it from the trail). Not
-- held (a change is in progress): the claim answers 'busy', and the caller claims again.
--
-- A claim of a tenant with a cap (max_concurrent_leases) takes, in PICK, a free row of the
-- tenant's `tenant_slots` (no lease, or an expired one; not over a lowered cap) with FOR UPDATE
-- SKIP LOCKED, before its credential slot, and grants only with one: the tenant's capacity is
-- that set of rows, decided on rows the claim locks exactly like a credential's (a row a
-- concurrent claim has just filled fails the re-check of the locked row and is passed over;
-- `tenants::a_claim_paused_before_the_tenant_lock...` holds a claim there). Within one PICK two
-- claims of the call may pick the same tenant row, so a claim wins a round only as the first of
-- its credential and the first of its tenant row; each claim starts its search at a random row
-- below the cap (wrapping around), so that the claims of one tenant in one call rarely meet on a
-- row and rarely need another round. A tenant row held by another transaction is skipped; if,
-- read after the claim, the tenant still has a free row, the answer is not 'tenant_limit' but
-- what the credentials say ('busy' when one may serve at once: the caller claims again), so a
-- claim racing its own tenant's claims gets no false 429.
--
-- Tenant windows: a claim of a tenant with rate windows (a `tenant_windows` row) locks that row
-- in PICK with FOR UPDATE SKIP LOCKED when every window has room for it
-- (credpool_window_room, on the locked row: a window a concurrent claim has just charged fails
-- the re-check; `tenant_windows::a_claim_paused_before_the_tenant_window_lock...`), and grants
-- only with it; GRANT charges it as a credential's. One claim of a tenant with windows wins a
-- round (the next round sees its charge). A row held by another transaction is skipped, and the
-- answer is 'tenant_limit' only if, read after the claim, a window has no room ('tenant_window'
-- with the moment it frees; NULL when a window can never hold the reservation). The claims of a
-- tenant with windows queue on its row as those of a credential with windows do; a tenant
-- without windows has no row, and its claims lock nothing of it.
--
-- FAIR SHARE (issue 29): a claim with "waiting" (its request waits up to wait_ms; not a request
-- that answers at once: nobody is refused while a slot is free) yields, before any pick, when
-- another tenant waits for its pool further below its weighted share (credpool_fair_share_ahead):
-- its answer is 'yield' and `yield_to` that tenant, whose waiter the caller wakes in its stead.
-- Decided on this call's snapshot: a share is an order among waiters, never a limit. A waiting
-- claim that got nothing writes its request's pool_waiters row (a later claim of the same request
-- finds it there; a strict affinity claim, which waits for one credential, writes none); one that
-- got a lease deletes it. Only the request's own claims write its row
-- (one after the other), so that write never waits.
--
-- Two shapes of pick, one for each shape of candidate list: a claim none of whose candidates has
-- windows locks only the slot row (a credential without windows must not make concurrent claims
-- queue on one row), and passes over a slot whose `windowed` gate says its credential has windows
-- now; a claim with a candidate that has windows locks that credential's lease_windows row with
-- the slot row (candidates without windows in the same list lock their empty row too).
--
-- Locks: the tenant's advisory lock in shared mode, tried; the tenant slot row and the
-- tenant_windows row, the slot row (and the lease_windows row), with SKIP LOCKED; request
-- ids' and affinity keys' advisory locks with a try-lock; affinity_bindings rows with SKIP LOCKED
-- (and the key share lock of the binding's foreign key on the credential row of a slot this call
-- holds, which no transaction holding a conflicting lock can have: docs/design.md "Lock order").
-- The call never waits for a lock, so any number of claims can share a
-- transaction without ever being part of a deadlock.
--
-- Clock: statement_timestamp(), the start of the call, decides usability, expiry and window room
-- (a lease that expires while the call runs is treated as still held). granted_at is
-- clock_timestamp(), read once per claim when its slot row is read, which for a slot freed after
-- the snapshot is after the lock: the slot was freed by a transaction that committed before this
-- claim saw it free, so the trail never shows two leases of one slot overlapping.
--
-- Plans: index probes whatever the planner's statistics say (a pool just loaded, never analyzed):
-- one primary-key probe per candidate into credentials (the LATERAL ... LIMIT 1 keeps the planner
-- from scanning the pool through its (provider, pool) index), lease_windows and lease_slots, and
-- the function's settings rule out the scans, joins and materializations that read whole tables
-- (a generic plan, which PL/pgSQL uses from a statement's sixth run on, would otherwise read the
-- slots table once into memory rather than probe it per candidate when it has no statistics).
DROP FUNCTION IF EXISTS credpool_claim(jsonb);
DROP FUNCTION IF EXISTS credpool_begin_lease(lease_slots, uuid, text, text, text, integer,
    timestamptz, bigint, text, text, text, timestamptz, boolean);
CREATE FUNCTION credpool_claim(p_claims jsonb)
RETURNS TABLE (claim integer, pool_version bigint, key_id text, lease_id uuid, lease_pool text,
               granted_at timestamptz, lease_until timestamptz, probe boolean,
               provider_model text, sealed_secret bytea, pruned_expired boolean, fence bigint,
               request text, frees_at timestamptz, held_by text, tenant text, db_now timestamptz,
               -- AFFINITY: 'hit', 'new', 'moved' for a grant; 'bound' for a strict claim that
               -- waits for its bound credential; NULL without an affinity_key
               affinity text,
               -- FAIR SHARE: with request 'yield', the tenant yielded to
               yield_to text)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan SET join_collapse_limit = 1 SET from_collapse_limit = 1
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := statement_timestamp();
    v_count integer := jsonb_array_length(p_claims);
    -- the claims; v_number: each one's place in p_claims (the answer's `claim`)
    v_number integer[];
    v_ranked jsonb[];
    v_provider text[];
    v_pool text[];
    v_model text[];
    v_lease uuid[];
    v_holder text[];
    v_seconds integer[];
    v_tokens bigint[];
    v_request_id text[];
    v_digest text[];
    v_windowed boolean[];
    v_pool_version bigint[];
    -- each claim's tenant (NULL: its key is unknown or revoked)
    v_tenant text[];
    -- whether the call holds each claim's tenant's advisory lock in shared mode (tried)
    v_steady boolean[];
    -- where each claim of a capped tenant starts looking for a free tenant slot row: a random
    -- row below the cap, so that the claims of one call rarely pick the same row (of the claims
    -- that pick one row, only the first wins the round; starting all at row 0 made a call of n
    -- claims of one tenant take n rounds)
    v_tenant_start integer[];
    -- claims answered before any pick (request ids), and their `request`
    v_done boolean[];
    v_request text[];
    -- the claims the next round picks for
    v_open integer[];
    -- whether a winner of this round ends an expired lease to take its slot, names a request_id,
    -- is a probe
    v_pruned boolean;
    v_requested boolean;
    v_probed boolean;
    -- one round's winners (claim order): the claim, its slot row as picked, what the grant and
    -- the answer need of its credential
    w_claim integer[];
    w_slot lease_slots[];
    w_status text[];
    w_cooldown timestamptz[];
    w_at timestamptz[];
    w_charge boolean[];
    w_secret bytea[];
    w_model text[];
    w_token timestamptz[];
    w_tenant_slot integer[];
    w_tenant_charge boolean[];
    -- every lease the call answers with (granted, or replayed): the claim, the slot row as
    -- granted, the sealed secret and the provider's model handed out, whether an expired lease
    -- was ended to make room
    g_claim integer[] := '{}';
    g_slot lease_slots[] := '{}';
    g_secret bytea[] := '{}';
    g_model text[] := '{}';
    g_pruned boolean[] := '{}';
    v_requests text[];
    q record;
    prior record;
    -- AFFINITY: each claim's affinity_key (NULL: none), the pool sequence it asked for (its
    -- first pool is the binding's), TTL in seconds, whether strict; its live binding's key_id,
    -- whether strict confines it to that credential; whether any claim names an affinity_key;
    -- the grants (positions in g_claim) whose binding this call writes
    v_affinity_key text[];
    v_affinity_pools jsonb[];
    v_affinity_ttl integer[];
    v_affinity_strict boolean[];
    v_bound text[];
    v_bound_only boolean[];
    v_affine boolean;
    v_bind integer[];
    -- FAIR SHARE: each waiting claim's "waiting" and its request's arrival (NULL: it does not
    -- wait), and the tenant each yielding claim yields to
    v_waiting jsonb[];
    v_since timestamptz[];
    v_yield_to text[];
BEGIN
    IF v_count = 0 THEN
        RETURN;
    END IF;
    -- The claims, read once, in one statement: each claim's pool version, read before any
    -- candidate, and whether a candidate of it has rate windows (the slots' `windowed` gate covers
    -- a credential given windows since). From here on a claim is its position in these arrays
    -- (its place in p_claims, as the rows are read in that order); the answer names each by
    -- v_number, so it never depends on that order.
    WITH e AS (
        SELECT x.n::integer AS n, x.c, x.c ->> 'provider' AS provider, x.c ->> 'pool' AS pool
        FROM jsonb_array_elements(p_claims) WITH ORDINALITY AS x (c, n)
    ),
    pv AS (
        SELECT d.provider, d.pool, credpool_pool_version(d.provider, d.pool) AS version
        FROM (SELECT DISTINCT e.provider, e.pool FROM e) AS d
    )
    SELECT array_agg(o.c -> 'ranked'), array_agg(o.provider), array_agg(o.pool),
           array_agg(o.c ->> 'model'), array_agg((o.c ->> 'lease_id')::uuid),
           array_agg(o.c ->> 'holder'), array_agg((o.c ->> 'lease_seconds')::integer),
           array_agg(coalesce((o.c ->> 'tokens')::bigint, 0)), array_agg(o.c ->> 'request_id'),
           array_agg(o.c ->> 'request_digest'), array_agg(o.version), array_agg(o.windowed),
           array_agg(o.n), array_agg(o.tenant),
           array_agg(floor(random() * coalesce(o.cap, 0))::integer),
           -- AFFINITY: the claim's affinity fields
           array_agg(o.c ->> 'affinity_key'), array_agg(o.c -> 'affinity_pools'),
           array_agg(coalesce((o.c ->> 'affinity_ttl_seconds')::integer, 3600)),
           array_agg(coalesce(o.c ->> 'affinity_mode' = 'strict', false)),
           array_agg(o.c -> 'waiting'), array_agg((o.c -> 'waiting' ->> 'since')::timestamptz),
           array_agg(o.steady)
    INTO v_ranked, v_provider, v_pool, v_model, v_lease, v_holder, v_seconds, v_tokens,
         v_request_id, v_digest, v_pool_version, v_windowed, v_number, v_tenant,
         v_tenant_start, v_affinity_key, v_affinity_pools, v_affinity_ttl, v_affinity_strict,
         v_waiting, v_since, v_steady
    FROM (
        SELECT e.n, e.c, e.provider, e.pool, pv.version, t.tenant_id AS tenant, t.steady,
               t.max_concurrent_leases AS cap,
               -- (a probe per candidate: LIMIT 1 keeps the planner from reading credentials
               -- in search of the few with windows)
               EXISTS (SELECT 1
                       FROM jsonb_array_elements_text(e.c -> 'ranked') AS r (key_id)
                       CROSS JOIN LATERAL (
                           SELECT c.rate_limits FROM credentials c WHERE c.key_id = r.key_id LIMIT 1
                       ) AS c
                       WHERE c.rate_limits <> '[]'::jsonb) AS windowed
        FROM e
        JOIN pv ON pv.provider = e.provider AND pv.pool = e.pool
        -- the tenant: of the live key the claim presented, else (the internal key) `default`
        -- and its advisory lock in shared mode, tried: held, no change of the tenant commits
        -- before this call does, so what the later statements read of it stays true
        LEFT JOIN LATERAL (
            SELECT t.tenant_id, t.max_concurrent_leases,
                   pg_try_advisory_xact_lock_shared(
                       hashtextextended('credpool.tenant:' || t.tenant_id, 0)) AS steady
            FROM credpool_key_tenant(e.c ->> 'key_hash') AS k (tenant)
            JOIN tenants t ON t.tenant_id = k.tenant
        ) AS t ON true
        ORDER BY e.n
    ) AS o;

    -- AFFINITY, read: each claim's live binding, its credential first in the claim's ranked list
    -- (taken out of the rest); a claim whose list had no candidate with windows but whose bound
    -- credential has them picks with the windows' shape. Strict, while the bound credential
    -- could serve but for slots and windows (read from this snapshot, like every candidate's
    -- credential row): that credential alone, in its own pool; nothing in the sequence's others.
    -- Run only when a claim names an affinity_key.
    v_affine := array_remove(v_affinity_key, NULL) <> '{}';
    IF v_affine THEN
        SELECT array_agg(b.key_id ORDER BY k.n),
               array_agg(CASE
                   WHEN b.key_id IS NULL THEN v_ranked[k.n]
                   WHEN x.confined THEN CASE WHEN (x.c).pool = v_pool[k.n]
                                             THEN jsonb_build_array(b.key_id) ELSE '[]' END
                   ELSE jsonb_build_array(b.key_id) || (v_ranked[k.n] - b.key_id) END ORDER BY k.n),
               array_agg(v_windowed[k.n] OR coalesce((x.c).rate_limits <> '[]'::jsonb, false)
                         ORDER BY k.n),
               array_agg(coalesce(x.confined, false) ORDER BY k.n)
        INTO v_bound, v_ranked, v_windowed, v_bound_only
        FROM generate_subscripts(v_affinity_key, 1) AS k (n)
        LEFT JOIN LATERAL (
            SELECT b.key_id
            FROM affinity_bindings b
            WHERE b.tenant = v_tenant[k.n] AND b.provider = v_provider[k.n]
              AND b.pool = v_affinity_pools[k.n] ->> 0 AND b.affinity_key = v_affinity_key[k.n]
              AND b.expires_at > v_now
            LIMIT 1
        ) AS b ON v_affinity_key[k.n] IS NOT NULL
        LEFT JOIN LATERAL (
            SELECT c,
                   v_affinity_strict[k.n] AND v_affinity_pools[k.n] ? c.pool
                   AND credpool_may_serve(c, v_provider[k.n], c.pool, v_model[k.n], v_now) AS confined
            FROM credentials c
            WHERE c.key_id = b.key_id
            LIMIT 1
        ) AS x ON true;
    END IF;

    -- Request ids: a claim whose request_id another transaction is claiming for right now is
    -- 'in_flight'; one whose request_id has a live lease replays it (or is a 'conflict'); of the
    -- claims of this call that name one request_id, the first claims and the others are
    -- 'in_flight' (claimed again, they replay its lease).
    v_done := array_fill(false, ARRAY[v_count]);
    v_request := array_fill(NULL::text, ARRAY[v_count]);
    -- a claim without a tenant presented no live key: refused, nothing looked at; one whose
    -- tenant an operator is changing right now (its advisory lock held): 'busy', claim again
    FOR q IN SELECT k AS n FROM generate_subscripts(v_tenant, 1) AS k
             WHERE v_tenant[k] IS NULL OR NOT v_steady[k] LOOP
        v_request[q.n] := CASE WHEN v_tenant[q.n] IS NULL THEN 'unauthorized' ELSE 'busy' END;
        v_done[q.n] := true;
        v_request_id[q.n] := NULL;
    END LOOP;
    IF array_remove(v_request_id, NULL) <> '{}' THEN
        SELECT coalesce(array_agg(ids.request_id), '{}') INTO v_requests
        FROM (SELECT DISTINCT r AS request_id FROM unnest(v_request_id) AS r WHERE r IS NOT NULL) AS ids
        WHERE pg_try_advisory_xact_lock(hashtextextended('credpool.request_id:' || ids.request_id, 0));
        FOR q IN SELECT k AS n FROM generate_subscripts(v_request_id, 1) AS k
                 WHERE v_request_id[k] IS NOT NULL ORDER BY k LOOP
            IF NOT v_request_id[q.n] = ANY (v_requests)
               OR v_request_id[q.n] = ANY (v_request_id[:q.n - 1]) THEN
                v_request[q.n] := 'in_flight';
                v_done[q.n] := true;
                CONTINUE;
            END IF;
            -- (a request id names a lease of one tenant: another tenant's request conflicts)
            SELECT s, r.request_digest = v_digest[q.n] AND s.tenant IS NOT DISTINCT FROM v_tenant[q.n]
                          AS same_request, c.secret_ciphertext,
                   coalesce(c.model_aliases ->> v_model[q.n], v_model[q.n]) AS provider_model
            INTO prior
            FROM lease_requests r
            JOIN lease_slots s ON s.key_id = r.key_id AND s.lease_id = r.lease_id
            JOIN credentials c ON c.key_id = s.key_id
            WHERE r.request_id = v_request_id[q.n] AND s.lease_until > v_now;
            IF FOUND THEN
                v_done[q.n] := true;
                IF prior.same_request THEN
                    v_request[q.n] := 'replayed';
                    g_claim := g_claim || q.n;
                    g_slot := g_slot || prior.s;
                    g_secret := g_secret || prior.secret_ciphertext;
                    g_model := g_model || prior.provider_model;
                    g_pruned := g_pruned || false;
                ELSE
                    v_request[q.n] := 'conflict';
                END IF;
            END IF;
        END LOOP;
    END IF;

    -- FAIR SHARE: a waiting claim yields to a tenant further below its share waiting for its pool
    -- (the claims of this call for the same pool that go ahead before it count as in flight)
    IF array_remove(v_since, NULL) <> '{}' THEN
        FOR q IN SELECT k AS n FROM generate_subscripts(v_since, 1) AS k
                 WHERE v_since[k] IS NOT NULL AND NOT v_done[k] ORDER BY k LOOP
            v_yield_to[q.n] := credpool_fair_share_ahead(v_provider[q.n], v_pool[q.n], v_model[q.n],
                v_tenant[q.n], v_since[q.n],
                ARRAY(SELECT v_tenant[j] FROM generate_subscripts(v_since, 1) AS j
                      WHERE j < q.n AND v_since[j] IS NOT NULL AND NOT v_done[j]
                        AND v_provider[j] = v_provider[q.n] AND v_pool[j] = v_pool[q.n]),
                v_now);
            IF v_yield_to[q.n] IS NOT NULL THEN
                v_request[q.n] := 'yield';
                v_done[q.n] := true;
            END IF;
        END LOOP;
    END IF;

    v_open := ARRAY(SELECT k FROM generate_subscripts(v_done, 1) AS k WHERE NOT v_done[k] ORDER BY k);
    WHILE cardinality(v_open) > 0 LOOP
        -- PICK: each open claim's first candidate with room, locked; the first claim (in array
        -- order) that picked a credential wins it, the others are open again
        SELECT coalesce(array_agg(p.n) FILTER (WHERE p.first), '{}'),
               array_agg(p.s) FILTER (WHERE p.first),
               array_agg(p.status) FILTER (WHERE p.first),
               array_agg(p.cooldown_until) FILTER (WHERE p.first),
               array_agg(p.at) FILTER (WHERE p.first),
               array_agg(p.windowed) FILTER (WHERE p.first),
               array_agg(p.secret_ciphertext) FILTER (WHERE p.first),
               array_agg(p.provider_model) FILTER (WHERE p.first),
               array_agg(p.token_expires_at) FILTER (WHERE p.first),
               coalesce(array_agg(p.n) FILTER (WHERE NOT p.first), '{}'),
               coalesce(bool_or((p.s).lease_id IS NOT NULL) FILTER (WHERE p.first), false),
               coalesce(bool_or(v_request_id[p.n] IS NOT NULL) FILTER (WHERE p.first), false),
               coalesce(bool_or(p.status <> 'available') FILTER (WHERE p.first), false),
               array_agg(p.tenant_slot) FILTER (WHERE p.first),
               array_agg(p.tenant_windowed) FILTER (WHERE p.first)
        INTO w_claim, w_slot, w_status, w_cooldown, w_at, w_charge, w_secret, w_model, w_token,
             v_open, v_pruned, v_requested, v_probed, w_tenant_slot, w_tenant_charge
        FROM (
            SELECT o.*,
                   row_number() OVER (PARTITION BY (o.s).key_id ORDER BY o.n) = 1
                   AND row_number() OVER (PARTITION BY v_tenant[o.n], coalesce(o.tenant_slot, -o.n)
                                          ORDER BY o.n) = 1
                   -- (one grant per round charges a tenant's windows, as a credential's)
                   AND row_number() OVER (PARTITION BY v_tenant[o.n],
                                                       CASE WHEN NOT o.tenant_windowed THEN o.n END
                                          ORDER BY o.n) = 1 AS first
            FROM (
                -- what each claim's tenant needs, as it is now (this statement's snapshot, taken
                -- after the call holds the tenant's advisory lock in shared mode, so a change of
                -- the tenant either committed before it or waits for this call): with a cap, a
                -- free row of its tenant_slots, from this claim's starting row on, else (only
                -- then) the first before it ("Tenants" above); with windows, its tenant_windows
                -- row, locked, when every window has room ("Tenant windows" above)
                WITH tenancy AS (
                    SELECT q.n, tn.capped, ts.slot AS tenant_slot,
                           coalesce(twx.windowed, false) AS tenant_windowed,
                           twl.tenant_id IS NOT NULL AS tenant_window_held
                    FROM unnest(v_open) AS q (n)
                    CROSS JOIN LATERAL (
                        SELECT t.max_concurrent_leases IS NOT NULL AS capped
                        FROM tenants t WHERE t.tenant_id = v_tenant[q.n] LIMIT 1
                    ) AS tn
                    LEFT JOIN LATERAL (
                        SELECT t.slot
                        FROM tenant_slots t
                        WHERE tn.capped AND (SELECT credpool_test_hook('claim.before_tenant_lock'))
                          AND t.tenant_id = v_tenant[q.n] AND t.slot >= v_tenant_start[q.n]
                          AND credpool_tenant_slot_open(t, v_now)
                        ORDER BY t.slot
                        LIMIT 1
                        FOR UPDATE SKIP LOCKED
                    ) AS ts_after ON true
                    LEFT JOIN LATERAL (
                        SELECT t.slot
                        FROM tenant_slots t
                        WHERE tn.capped AND ts_after.slot IS NULL
                          AND t.tenant_id = v_tenant[q.n] AND t.slot < v_tenant_start[q.n]
                          AND credpool_tenant_slot_open(t, v_now)
                        ORDER BY t.slot
                        LIMIT 1
                        FOR UPDATE SKIP LOCKED
                    ) AS ts_before ON true
                    CROSS JOIN LATERAL (SELECT coalesce(ts_after.slot, ts_before.slot) AS slot) AS ts
                    LEFT JOIN LATERAL (
                        SELECT true AS windowed FROM tenant_windows tw
                        WHERE tw.tenant_id = v_tenant[q.n] LIMIT 1
                    ) AS twx ON true
                    LEFT JOIN LATERAL (
                        SELECT tw.tenant_id
                        FROM tenant_windows tw
                        WHERE twx.windowed AND tw.tenant_id = v_tenant[q.n]
                          AND (SELECT credpool_test_hook('claim.before_tenant_window_lock'))
                          AND credpool_window_room(credpool_tenant_window(tw), v_now, v_tokens[q.n])
                        LIMIT 1
                        FOR UPDATE SKIP LOCKED
                    ) AS twl ON true
                )
                SELECT q.n, x.*, false AS windowed, q.tenant_slot, q.tenant_windowed
                FROM tenancy q
                CROSS JOIN LATERAL (
                    SELECT s, c.status, c.cooldown_until, c.secret_ciphertext,
                           coalesce(c.model_aliases ->> v_model[q.n], v_model[q.n]) AS provider_model,
                           clock_timestamp() AS at, c.token_expires_at
                    FROM jsonb_array_elements_text(v_ranked[q.n]) WITH ORDINALITY AS r (key_id, rank)
                    CROSS JOIN LATERAL (
                        SELECT * FROM credentials c WHERE c.key_id = r.key_id LIMIT 1
                    ) c
                    JOIN lease_slots s ON s.key_id = c.key_id
                    WHERE (NOT q.capped OR q.tenant_slot IS NOT NULL)
                      AND (NOT q.tenant_windowed OR q.tenant_window_held)
                      AND (SELECT credpool_test_hook('claim.before_lock'))
                      AND credpool_may_serve(c, v_provider[q.n], v_pool[q.n], v_model[q.n], v_now)
                      AND credpool_slot_open(s, c.status, v_now)
                      AND s.config_version = c.config_version
                      AND credpool_token_lasts(c, v_now + make_interval(secs => v_seconds[q.n]))
                      AND NOT s.windowed
                    ORDER BY r.rank, s.slot
                    LIMIT 1
                    FOR UPDATE OF s SKIP LOCKED
                ) AS x
                WHERE NOT v_windowed[q.n]
                UNION ALL
                SELECT q.n, x.*, true AS windowed, q.tenant_slot, q.tenant_windowed
                FROM tenancy q
                CROSS JOIN LATERAL (
                    SELECT s, c.status, c.cooldown_until, c.secret_ciphertext,
                           coalesce(c.model_aliases ->> v_model[q.n], v_model[q.n]) AS provider_model,
                           clock_timestamp() AS at, c.token_expires_at
                    FROM jsonb_array_elements_text(v_ranked[q.n]) WITH ORDINALITY AS r (key_id, rank)
                    CROSS JOIN LATERAL (
                        SELECT * FROM credentials c WHERE c.key_id = r.key_id LIMIT 1
                    ) c
                    JOIN lease_windows w ON w.key_id = c.key_id
                    JOIN lease_slots s ON s.key_id = c.key_id
                    WHERE (NOT q.capped OR q.tenant_slot IS NOT NULL)
                      AND (NOT q.tenant_windowed OR q.tenant_window_held)
                      AND (SELECT credpool_test_hook('claim.before_lock'))
                      AND credpool_may_serve(c, v_provider[q.n], v_pool[q.n], v_model[q.n], v_now)
                      AND credpool_slot_open(s, c.status, v_now)
                      AND s.config_version = c.config_version
                      AND credpool_token_lasts(c, v_now + make_interval(secs => v_seconds[q.n]))
                      AND credpool_window_room(w, v_now, v_tokens[q.n])
                    ORDER BY r.rank, s.slot
                    LIMIT 1
                    FOR UPDATE OF w, s SKIP LOCKED
                ) AS x
                WHERE v_windowed[q.n]
            ) AS o
            ORDER BY o.n
        ) AS p;
        EXIT WHEN cardinality(w_claim) = 0;

        -- GRANT: the expired leases the winners' slots still carry end in the trail (at their
        -- own lease_until); then every winner's lease begins (slot row and `granted` trail row),
        -- in one statement
        IF v_pruned THEN
            PERFORM credpool_record_lease_ends(
                ARRAY(SELECT s FROM unnest(w_slot) AS s WHERE s.lease_id IS NOT NULL),
                ARRAY(SELECT 'expired' FROM unnest(w_slot) AS s WHERE s.lease_id IS NOT NULL),
                ARRAY(SELECT s.lease_until FROM unnest(w_slot) AS s WHERE s.lease_id IS NOT NULL));
        END IF;
        WITH won AS (
            SELECT w_claim[i] AS n, (w_slot[i]).key_id, (w_slot[i]).slot,
                   (w_slot[i]).lease_id IS NOT NULL AS pruned, w_status[i] AS status,
                   w_at[i] AS at, w_secret[i] AS secret, w_model[i] AS model,
                   w_token[i] AS token_expires_at, v_lease[w_claim[i]] AS lease_id,
                   v_provider[w_claim[i]] AS provider, v_pool[w_claim[i]] AS pool,
                   v_holder[w_claim[i]] AS holder, v_seconds[w_claim[i]] AS seconds,
                   v_tokens[w_claim[i]] AS tokens, v_tenant[w_claim[i]] AS tenant,
                   w_tenant_slot[i] AS tenant_slot
            FROM generate_subscripts(w_claim, 1) AS i
        ),
        granted AS (
            UPDATE lease_slots s
            SET lease_id = won.lease_id, provider = won.provider, pool = won.pool,
                holder = won.holder, granted_at = won.at,
                lease_until = least(won.at + make_interval(secs => won.seconds), won.token_expires_at),
                last_granted_at = won.at, probe = won.status <> 'available',
                fence = nextval('lease_fence_seq'), reserved_tokens = won.tokens,
                tenant = won.tenant, tenant_slot = won.tenant_slot
            FROM won
            WHERE s.key_id = won.key_id AND s.slot = won.slot
            RETURNING won.n, s, won.secret, won.model, won.pruned, won.tenant_slot
        ),
        -- a capped tenant's lease takes the tenant slot row PICK locked, with the same end
        tenant_held AS (
            UPDATE tenant_slots t
            SET lease_id = (g.s).lease_id, key_id = (g.s).key_id, lease_until = (g.s).lease_until
            FROM granted g
            WHERE t.tenant_id = (g.s).tenant AND t.slot = g.tenant_slot
        ),
        trail AS (
            INSERT INTO lease_events
                (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, fence, tokens,
                 tenant, affinity)
            SELECT 'granted', (g.s).lease_id, (g.s).key_id, (g.s).provider, (g.s).pool, (g.s).slot,
                   (g.s).holder, (g.s).lease_until, (g.s).granted_at, (g.s).fence,
                   (g.s).reserved_tokens, (g.s).tenant,
                   -- AFFINITY: the grant's result, for the dashboard's hit ratio
                   credpool_affinity_result(v_affinity_key[g.n], v_bound[g.n], (g.s).key_id)
            FROM granted g
        )
        SELECT g_claim || array_agg(g.n), g_slot || array_agg(g.s), g_secret || array_agg(g.secret),
               g_model || array_agg(g.model), g_pruned || array_agg(g.pruned)
        INTO g_claim, g_slot, g_secret, g_model, g_pruned
        FROM granted g;
        -- what only some winners need, each in a statement of its own run only then (a part of
        -- the statement above costs its start-up whether or not a row needs it): the windows
        -- charged (the credentials', the tenants'), the request ids' rows, the probes' trail rows
        IF true = ANY (w_charge) THEN
            UPDATE lease_windows lw
            SET (bucket_ids, bucket_charged) =
                (SELECT x.bucket_ids, x.bucket_charged
                 FROM credpool_window_charge(lw, w_at[i], v_tokens[w_claim[i]]) AS x)
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE w_charge[i] AND lw.key_id = (w_slot[i]).key_id
              AND cardinality(lw.window_kinds) > 0;
        END IF;
        IF true = ANY (w_tenant_charge) THEN
            UPDATE tenant_windows tw
            SET (bucket_ids, bucket_charged) =
                (SELECT x.bucket_ids, x.bucket_charged
                 FROM credpool_window_charge(credpool_tenant_window(tw), w_at[i],
                                             v_tokens[w_claim[i]]) AS x)
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE w_tenant_charge[i] AND tw.tenant_id = v_tenant[w_claim[i]];
        END IF;
        IF v_requested THEN
            INSERT INTO lease_requests AS r (request_id, request_digest, lease_id, key_id, granted_at)
            SELECT v_request_id[w_claim[i]], v_digest[w_claim[i]], v_lease[w_claim[i]],
                   (w_slot[i]).key_id, w_at[i]
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE v_request_id[w_claim[i]] IS NOT NULL
            ON CONFLICT ON CONSTRAINT lease_requests_pkey DO UPDATE
            SET request_digest = EXCLUDED.request_digest, lease_id = EXCLUDED.lease_id,
                key_id = EXCLUDED.key_id, granted_at = EXCLUDED.granted_at;
        END IF;
        IF v_probed THEN
            INSERT INTO credential_events
                (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at)
            SELECT (w_slot[i]).key_id, 'probe_granted', w_status[i], w_status[i],
                   'cooldown ended; single probe lease granted', w_cooldown[i],
                   v_lease[w_claim[i]], w_at[i]
            FROM generate_subscripts(w_claim, 1) AS i
            WHERE w_status[i] <> 'available';
        END IF;
    END LOOP;

    -- AFFINITY, write: the bindings of this call's grants (not replays), in one statement, the
    -- last grant of each affinity key in claim order. First the affinity keys' advisory locks,
    -- tried, in a statement of their own, so that the write's snapshot, taken after them, sees
    -- every binding the lock's last holder wrote: a row the write does not see then can only be
    -- inserted by a holder of the lock, so its INSERT never meets another transaction's row in
    -- progress. Then each existing row is locked with SKIP LOCKED (a row another transaction
    -- holds: an operator's delete cascading, the maintenance pass, a claim's write is left as
    -- it is), and the write touches only rows it locked or that do not exist.
    IF v_affine AND cardinality(g_claim) > 0 THEN
        SELECT coalesce(array_agg(d.i ORDER BY d.i), '{}')
        INTO v_bind
        FROM (
            SELECT DISTINCT ON (v_tenant[g_claim[i]], v_provider[g_claim[i]],
                                v_affinity_pools[g_claim[i]] ->> 0, v_affinity_key[g_claim[i]]) i
            FROM generate_subscripts(g_claim, 1) AS i
            WHERE v_affinity_key[g_claim[i]] IS NOT NULL AND v_request[g_claim[i]] IS NULL
            ORDER BY v_tenant[g_claim[i]], v_provider[g_claim[i]], v_affinity_pools[g_claim[i]] ->> 0,
                     v_affinity_key[g_claim[i]], g_claim[i] DESC
        ) AS d
        WHERE pg_try_advisory_xact_lock(credpool_affinity_lock(v_tenant[g_claim[d.i]], v_provider[g_claim[d.i]],
                  v_affinity_pools[g_claim[d.i]] ->> 0, v_affinity_key[g_claim[d.i]]));
        IF v_bind <> '{}' THEN
            WITH wanted AS (
                SELECT v_tenant[n] AS tenant, v_provider[n] AS provider,
                       v_affinity_pools[n] ->> 0 AS pool, v_affinity_key[n] AS affinity_key,
                       (g_slot[i]).key_id, (g_slot[i]).granted_at AS at, v_affinity_ttl[n] AS ttl
                FROM unnest(v_bind) AS i
                CROSS JOIN LATERAL (SELECT g_claim[i] AS n) AS x
            ),
            found AS (
                SELECT w.*, e.found, l.locked
                FROM wanted w
                LEFT JOIN LATERAL (
                    SELECT true AS found FROM affinity_bindings b
                    WHERE b.tenant = w.tenant AND b.provider = w.provider AND b.pool = w.pool
                      AND b.affinity_key = w.affinity_key
                    LIMIT 1
                ) AS e ON true
                LEFT JOIN LATERAL (
                    SELECT true AS locked FROM affinity_bindings b
                    WHERE b.tenant = w.tenant AND b.provider = w.provider AND b.pool = w.pool
                      AND b.affinity_key = w.affinity_key
                    FOR UPDATE SKIP LOCKED
                ) AS l ON e.found
            )
            INSERT INTO affinity_bindings AS b
                (tenant, provider, pool, affinity_key, key_id, bound_at, last_hit_at, expires_at)
            SELECT f.tenant, f.provider, f.pool, f.affinity_key, f.key_id, f.at, f.at,
                   f.at + make_interval(secs => f.ttl)
            FROM found f
            WHERE f.found IS NULL OR f.locked
            ON CONFLICT ON CONSTRAINT affinity_bindings_pkey DO UPDATE
            SET key_id = EXCLUDED.key_id,
                -- a hit keeps when the conversation was bound; a move or an expired binding
                -- starts anew
                bound_at = CASE WHEN b.key_id = EXCLUDED.key_id AND b.expires_at > EXCLUDED.bound_at
                                THEN b.bound_at ELSE EXCLUDED.bound_at END,
                last_hit_at = EXCLUDED.last_hit_at, expires_at = EXCLUDED.expires_at;
        END IF;
    END IF;

    -- FAIR SHARE: a waiting claim that got nothing is (still) waiting: its request's row written
    -- (kept as it is when there); one that got a lease (or replayed one) waits no more
    IF array_remove(v_since, NULL) <> '{}' THEN
        DELETE FROM pool_waiters w
        WHERE w.waiter IN (SELECT (v_waiting[g_claim[i]] ->> 'waiter')::uuid
                           FROM generate_subscripts(g_claim, 1) AS i
                           WHERE v_since[g_claim[i]] IS NOT NULL);
        INSERT INTO pool_waiters (waiter, instance, tenant, provider, pools, model, since, until)
        SELECT (v_waiting[k] ->> 'waiter')::uuid, v_waiting[k] ->> 'instance', v_tenant[k],
               v_provider[k], ARRAY(SELECT jsonb_array_elements_text(v_waiting[k] -> 'pools')),
               v_model[k], v_since[k], (v_waiting[k] ->> 'until')::timestamptz
        FROM generate_subscripts(v_since, 1) AS k
        WHERE v_since[k] IS NOT NULL AND v_tenant[k] IS NOT NULL AND NOT k = ANY (g_claim)
          AND v_request[k] IS DISTINCT FROM 'conflict' AND v_request[k] IS DISTINCT FROM 'in_flight'
          -- (a strict affinity waits for one credential: other tenants' claims must not yield
          -- every other slot of the pool to it)
          AND NOT v_affinity_strict[k]
        ON CONFLICT (waiter) DO NOTHING;
    END IF;

    -- The answers, in claim order. Nothing granted: when may a candidate serve it (read now)? A
    -- candidate whose slot or window row another transaction held (a concurrent claim, the
    -- reaper, an operator's change) was passed over without knowing what that transaction
    -- leaves: if, read now, one may serve at once, say so ('busy': the caller claims again).
    -- A claim of a capped tenant that got nothing: is every slot row of its tenant held by a live
    -- lease (read now)? Then it is 'tenant_limit', whatever the credentials say.
    RETURN QUERY
    SELECT v_number[k.n], v_pool_version[k.n], (g_slot[g.i]).key_id, (g_slot[g.i]).lease_id,
           (g_slot[g.i]).pool, (g_slot[g.i]).granted_at, (g_slot[g.i]).lease_until,
           (g_slot[g.i]).probe, g_model[g.i], g_secret[g.i], g_pruned[g.i], (g_slot[g.i]).fence,
           CASE WHEN v_request[k.n] IS NOT NULL THEN v_request[k.n]
                WHEN tl.full OR tw.full THEN 'tenant_limit'
                WHEN g.i IS NULL AND f.at <= v_now THEN 'busy' END,
           -- (a tenant both at its cap and out of window room: the later of the two; NULL when
           -- its window can never hold the reservation)
           CASE WHEN tw.full AND tw.frees_at IS NULL THEN NULL
                WHEN tl.full OR tw.full THEN greatest(CASE WHEN tl.full THEN tl.frees_at END,
                                                      CASE WHEN tw.full THEN tw.frees_at END)
                ELSE f.at END,
           CASE WHEN tw.full AND (tw.frees_at IS NULL OR NOT coalesce(tl.full, false)
                                  OR tw.frees_at > tl.frees_at) THEN 'tenant_window'
                WHEN tl.full THEN 'tenant' ELSE f.held_by END,
           coalesce((g_slot[g.i]).tenant, v_tenant[k.n]), v_now,
           -- AFFINITY: the grant's result (a replay says none); a strict claim confined to its
           -- bound credential that granted nothing: 'bound'
           CASE WHEN g.i IS NOT NULL AND v_request[k.n] IS NULL
                THEN credpool_affinity_result(v_affinity_key[k.n], v_bound[k.n], (g_slot[g.i]).key_id)
                WHEN g.i IS NULL AND v_bound_only[k.n] THEN 'bound' END,
           v_yield_to[k.n]
    FROM generate_subscripts(v_done, 1) AS k (n)
    CROSS JOIN LATERAL (SELECT array_position(g_claim, k.n) AS i) AS g
    -- (a tenant has slot rows while it has a cap, and a tenant_windows row while it has windows)
    LEFT JOIN LATERAL (
        SELECT NOT coalesce(bool_or(credpool_tenant_slot_open(t, v_now)), false) AS full,
               min(t.lease_until) FILTER (WHERE t.lease_until > v_now) AS frees_at
        FROM tenant_slots t
        WHERE g.i IS NULL AND NOT v_done[k.n] AND t.tenant_id = v_tenant[k.n]
        HAVING count(*) > 0
    ) AS tl ON true
    LEFT JOIN LATERAL (
        SELECT NOT credpool_window_room(credpool_tenant_window(tw), v_now, v_tokens[k.n]) AS full,
               nullif(credpool_window_frees_at(credpool_tenant_window(tw), v_now, v_tokens[k.n]),
                      'infinity') AS frees_at
        FROM tenant_windows tw
        WHERE g.i IS NULL AND NOT v_done[k.n] AND tw.tenant_id = v_tenant[k.n]
    ) AS tw ON true
    LEFT JOIN LATERAL (
        SELECT greatest(f.at, t.at) AS at,
               CASE WHEN t.at > f.at THEN 'token_refresh' ELSE f.held_by END AS held_by
        FROM jsonb_array_elements_text(v_ranked[k.n]) AS r (key_id)
        JOIN credentials c ON c.key_id = r.key_id
        LEFT JOIN lease_windows w ON w.key_id = c.key_id
        CROSS JOIN LATERAL credpool_frees_at(c, w, v_tokens[k.n], v_now) AS f
        CROSS JOIN LATERAL credpool_token_refreshed_at(
            c, v_now + make_interval(secs => v_seconds[k.n]), v_now) AS t (at)
        WHERE g.i IS NULL AND NOT v_done[k.n]
          AND c.provider = v_provider[k.n] AND c.pool = v_pool[k.n]
          AND (v_model[k.n] = ANY (c.models) OR c.model_aliases ? v_model[k.n])
          AND NOT c.draining AND f.at IS NOT NULL AND t.at IS NOT NULL
        ORDER BY greatest(f.at, t.at)
        LIMIT 1
    ) AS f ON true
    ORDER BY k.n;
END;
$$;

-- RENEW, for one lease or a group: p_renewals jsonb is an array of {"lease_id", "key_id",
-- "provider", "pool", "fence" (or null), "lease_seconds", "key_hash" (as for RELEASE)}. A live
-- lease named by all of its values gets lease_until = now + lease_seconds and a `renewed` trail
-- row. Returns one row per renewal, in order: the new lease_until, or NULL when the lease is lost
-- (expired, released, unknown, or named with another key_id, provider, pool or fence), and
-- `authorized`: false when its key_hash names no live key, or a key of another tenant than the
-- lease's (credpool_key_tenant; lease_slots.tenant): nothing renewed. Never resurrects an expired
-- lease, even if its slot is still free: expiry is judged after the slot row's lock is taken, on
-- clock_timestamp().
-- A lease in a surplus row (over a lowered limit, see FIT) is renewed at most to the earliest
-- lease_until of its credential's rows within the limit, so it never outlives them: each of
-- those rows reopens when its lease ends, and by then no surplus lease counts. (Read from this
-- statement's snapshot: those ends only move later, and a row leaves that set only by FIT, which
-- needs this lease's row, or by END, which then closes it while this lease is held.)
-- An OAuth credential's lease is renewed at most to the expiry of the access token it holds:
-- the credential's token_expires_at when the lease was granted on the current generation
-- (granted_at >= oauth_credentials.generation_at), else its own lease_until (an older token,
-- whose expiry its lease_until already respects: no extension). So a lease never outlives its
-- token; the executor sees lease_until come back earlier than it asked and allocates again for
-- the refreshed token. (Read from this statement's snapshot: a refresh committed after it
-- began wrote a token this lease does not hold.)
-- A lease of a capped tenant moves its tenant slot row's lease_until in step (the row frees when
-- the lease does; see CLAIM, "Tenants").
-- Locks: the named leases' slot rows, ascending (key_id, slot), in one statement; then their
-- tenant slot rows, ascending (tenant_id, slot) (credpool_lock_tenant_slots).
DROP FUNCTION IF EXISTS credpool_renew(jsonb);
CREATE FUNCTION credpool_renew(p_renewals jsonb)
RETURNS TABLE (renewal integer, lease_until timestamptz, authorized boolean)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
BEGIN
    PERFORM 1
    FROM lease_slots s
    WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_renewals) AS e))
      AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid FROM jsonb_array_elements(p_renewals) AS e))
    ORDER BY s.key_id, s.slot
    FOR UPDATE;
    PERFORM credpool_lock_tenant_slots(ARRAY(
        SELECT s FROM lease_slots s
        WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_renewals) AS e))
          AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid
                                      FROM jsonb_array_elements(p_renewals) AS e))));
    v_now := clock_timestamp();

    RETURN QUERY
    WITH wanted AS (
        SELECT w.*, a.authorized
        FROM ROWS FROM (jsonb_to_recordset(p_renewals) AS (
                 lease_id uuid, key_id text, provider text, pool text, fence bigint, lease_seconds integer,
                 key_hash text))
             WITH ORDINALITY AS w (lease_id, key_id, provider, pool, fence, lease_seconds, key_hash, n)
        -- the key must be live (absent: the configured internal key, tenant `default`) and of the
        -- lease's tenant: a key of another tenant renews nothing, as an unknown key
        LEFT JOIN LATERAL credpool_key_tenant(w.key_hash) AS k (tenant) ON true
        LEFT JOIN lease_slots s ON s.key_id = w.key_id AND s.lease_id = w.lease_id
        CROSS JOIN LATERAL (
            SELECT k.tenant IS NOT NULL AND coalesce(s.tenant, k.tenant) = k.tenant AS authorized
        ) AS a
    ),
    renewed AS (
        UPDATE lease_slots s
        SET lease_until = least(
                CASE
                    WHEN NOT s.surplus THEN v_now + make_interval(secs => w.lease_seconds)
                    ELSE least(v_now + make_interval(secs => w.lease_seconds),
                               (SELECT min(o.lease_until) FROM lease_slots o
                                WHERE o.key_id = s.key_id AND NOT o.surplus AND o.lease_id IS NOT NULL))
                END,
                -- OAuth: never past the expiry of the token the lease holds (and never shorter
                -- than the lease already is, for the token's sake)
                coalesce((SELECT greatest(s.lease_until,
                                          CASE WHEN s.granted_at >= o.generation_at
                                               THEN c.token_expires_at ELSE s.lease_until END)
                          FROM oauth_credentials o
                          JOIN credentials c ON c.key_id = o.key_id
                          WHERE o.key_id = s.key_id), 'infinity'))
        FROM (SELECT DISTINCT ON (wanted.lease_id) * FROM wanted WHERE wanted.authorized
              ORDER BY wanted.lease_id, wanted.n) AS w
        WHERE s.lease_id = w.lease_id AND s.key_id = w.key_id AND s.provider = w.provider
          AND s.pool = w.pool AND (w.fence IS NULL OR s.fence = w.fence)
          AND s.lease_until > v_now
        RETURNING s.key_id, s.slot, s.lease_id, s.provider, s.pool, s.holder, s.lease_until, s.fence,
                  s.tenant, s.tenant_slot
    ),
    tenant_renewed AS (
        UPDATE tenant_slots t
        SET lease_until = r.lease_until
        FROM renewed r
        WHERE t.tenant_id = r.tenant AND t.slot = r.tenant_slot AND t.lease_id = r.lease_id
    ),
    trail AS (
        INSERT INTO lease_events
            (event, lease_id, key_id, provider, pool, slot, holder, lease_until, at, tenant)
        SELECT 'renewed', lease_id, key_id, provider, pool, slot, holder, lease_until, v_now, tenant
        FROM renewed
    )
    SELECT w.n::integer, r.lease_until, w.authorized
    FROM wanted w
    LEFT JOIN renewed r
        ON r.lease_id = w.lease_id AND r.key_id = w.key_id AND r.provider = w.provider
       AND r.pool = w.pool AND (w.fence IS NULL OR r.fence = w.fence)
    ORDER BY w.n;
END;
$$;

-- USAGE: the tokens a call really used replace its reservation in the token windows of its
-- credential `p_key_id` and of its tenant `p_tenant` (a lease granted at `p_granted_at`;
-- `p_delta` = usage - reservation). The caller holds the lease_windows row's lock and the
-- tenant_windows row's.
DROP FUNCTION IF EXISTS credpool_charge_usage(text, timestamptz, bigint);
CREATE OR REPLACE FUNCTION credpool_charge_usage(p_key_id text, p_tenant text,
    p_granted_at timestamptz, p_delta bigint)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE lease_windows w
    SET (bucket_ids, bucket_charged) =
        (SELECT x.bucket_ids, x.bucket_charged FROM credpool_window_adjust(w, p_granted_at, p_delta) x)
    WHERE w.key_id = p_key_id AND p_delta <> 0 AND 'tokens' = ANY (w.window_kinds);
    UPDATE tenant_windows tw
    SET (bucket_ids, bucket_charged) =
        (SELECT x.bucket_ids, x.bucket_charged
         FROM credpool_window_adjust(credpool_tenant_window(tw), p_granted_at, p_delta) x)
    WHERE tw.tenant_id = p_tenant AND p_delta <> 0 AND 'tokens' = ANY (tw.window_kinds);
END;
$$;

-- RELEASE, for one lease or a group: p_releases jsonb is an array of {"lease_id", "key_id",
-- "provider", "pool", "fence" (or null), "outcome" (or null), "usage_tokens" (or null),
-- "key_hash" (hex SHA-256 of the tenant key the executor presented, or null: the internal key,
-- tenant `default`)}. A release whose key_hash names no live key, or a key of another tenant than
-- the lease's (its slot row's `tenant`, or for a lease no longer in its slot, its `granted` trail
-- row's), does nothing (verdict 'unauthorized': no release, no late report; the key is read by this
-- call, so no replica honours a key once its revoke has committed). For each other, in the slot
-- row's lock:
--   * live and named by all of its values: ended as `released` with the outcome (verdict
--     'released');
--   * named by all of its values but expired: ended as `expired` at its own lease_until if it still
--     sits in its slot (verdict 'expired');
--   * in a slot but named with another key_id, provider, pool or fence: nothing (verdict
--     'mismatch');
--   * in no slot (never granted, released, reaped, reused): nothing (verdict 'not_found').
-- An outcome or a usage for an expired or ended lease that was granted with the values given is
-- recorded once as `outcome_after_expiry` (unique index lease_events_one_report_per_lease:
-- retries count once); the outcome still counts for health. A usage (tokens the call really used)
-- replaces the lease's reservation in its credential's token windows, once.
--
-- Returns one row per release, in order: the verdict; the credential (key_id); whether the lease
-- was a probe; `refit`: the slot was over a lowered limit, so the credential may be back under it
-- (the caller runs credpool_fit_slots in a transaction of its own once this one has committed);
-- `tenant_refit`: the lease's tenant, when the tenant is over a lowered cap (the caller runs
-- credpool_fit_tenant after the commit, likewise);
-- `usage_granted_at`, `usage_delta`: when a usage replaced a reservation, the lease's grant time
-- and usage - reservation (for the caller's view of the windows); `counted`: the outcome is to be
-- applied to health. For counted rows, the credential's health
-- columns, read under its row lock, and db_now, the clock after that lock: the caller computes
-- the new health (service/src/allocator/health.rs) and writes it with credpool_write_health in
-- the same transaction.
--
-- `auth_expired` on a lease of an OAuth credential's current token generation takes that token
-- out of traffic and makes its refresh due (below; a `token_rejected` row in
-- credential_events). `oauth`: the credential is an OAuth credential (for health: `auth_expired`
-- on any other credential is the provider refusing the key, as `auth_error`).
--
-- Locks, in the lock order: with an `auth_expired` report, first the operator locks and every
-- slot row, tenant slot row and lease_windows row of the credentials named
-- (credpool_lock_credentials without their credential rows); the named leases' slot rows,
-- ascending (key_id, slot), in one statement; their tenant slot rows, ascending (tenant_id, slot)
-- (credpool_lock_tenant_slots); the lease_windows rows of the credentials named with a usage,
-- ascending key_id; the tenant_windows rows of those leases' tenants, ascending tenant_id (whose
-- advisory locks, in shared mode, it takes before anything else); trail rows guarded by unique
-- indexes, ascending lease_id; then the credential
-- rows of counted outcomes, ascending key_id, in one statement (FOR NO KEY UPDATE; FOR UPDATE with
-- an `auth_expired` report, whose token write follows). Decision clock: clock_timestamp() after
-- the slot locks (`released` rows carry it as `at`).
--
-- p_caller_announces: the caller announces the slots its `released` rows freed once its
-- transaction has committed (credpool_announce_freed), so nothing in this transaction sends a
-- notification for them. A slot freed as `expired` is not announced at all: it was claimable
-- from its lease_until on, and waiters keep a timer for that moment.
DROP FUNCTION IF EXISTS credpool_release(jsonb);
DROP FUNCTION IF EXISTS credpool_release(jsonb, boolean);
CREATE FUNCTION credpool_release(p_releases jsonb, p_caller_announces boolean DEFAULT false)
RETURNS TABLE (release integer, verdict text, key_id text, probe boolean, refit boolean,
               tenant_refit text, usage_granted_at timestamptz, usage_delta bigint,
               counted boolean, status text, status_reason text, cooldown_until timestamptz,
               health_successes double precision, health_failures double precision,
               health_rate_limits double precision, health_decayed_at timestamptz,
               recent_failures timestamptz[], cooldowns_in_a_row integer,
               last_success_at timestamptz, recovered_at timestamptz, db_now timestamptz,
               oauth boolean)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz;
    v_health_now timestamptz;
    v_rejects boolean;
    -- per release: the grant time of a lease whose `auth_expired` report counts (else NULL)
    v_rejected_granted_at timestamptz[];
    -- one element per release, in request order (n): what it asked and what it found
    v_n integer[];
    v_lease uuid[];
    v_asked_key text[];
    v_provider text[];
    v_pool text[];
    v_fence bigint[];
    v_outcome text[];
    v_usage bigint[];
    v_slot lease_slots[];
    v_verdict text[];
    -- and what it did
    v_key text[];
    v_probe boolean[];
    v_refit boolean[];
    v_tenant_refit text[];
    v_counted boolean[];
    v_usage_at timestamptz[];
    v_usage_delta bigint[];
    v_late record;
    v_counted_keys text[];
    v_usage_tenants text[];
    i integer;
BEGIN
    -- The tenants of the leases named with a usage (the lease's slot row says which, or, for a
    -- lease no longer in it, its `granted` row; a lease's tenant never changes, so this read
    -- needs no lock), ascending: their advisory locks in shared mode, before any other lock (no
    -- transaction takes an operator lock before a tenant's), so that no change of one of them
    -- adds or removes its tenant_windows row, or seeds a new window from the trail, while this
    -- release charges its usage: the rows locked below are the rows the usage is charged to.
    v_usage_tenants := ARRAY(
        SELECT DISTINCT coalesce(s.tenant, g.tenant)
        FROM jsonb_array_elements(p_releases) AS e
        LEFT JOIN lease_slots s
            ON s.key_id = e ->> 'key_id' AND s.lease_id = (e ->> 'lease_id')::uuid
        LEFT JOIN LATERAL (
            SELECT g.tenant FROM lease_events g
            WHERE s.lease_id IS NULL AND g.lease_id = (e ->> 'lease_id')::uuid
              AND g.event = 'granted'
            LIMIT 1
        ) AS g ON true
        WHERE e ->> 'usage_tokens' IS NOT NULL AND coalesce(s.tenant, g.tenant) IS NOT NULL
        ORDER BY 1);
    IF v_usage_tenants <> '{}' THEN
        PERFORM pg_advisory_xact_lock_shared(hashtextextended('credpool.tenant:' || t.tenant, 0))
        FROM unnest(v_usage_tenants) WITH ORDINALITY AS t (tenant, n);
    END IF;
    IF p_caller_announces THEN
        -- the caller announces the released slots after its commit (credpool_announce_freed):
        -- no NOTIFY from this transaction (see lease_slots_notify_freed)
        PERFORM set_config('credpool.caller_announces_freed', 'on', true);
    END IF;
    -- An `auth_expired` report may take its token out of traffic, a write of the credential row
    -- that moves config_version into every slot row of the credential: so every slot row of
    -- every credential named first (with their tenant and windows rows, in the lock order:
    -- credpool_lock_credentials), and their credential rows only after the trail rows, below.
    -- Rare; a call without such a report locks only its leases' rows.
    v_rejects := EXISTS (SELECT 1 FROM jsonb_array_elements(p_releases) AS e
                         WHERE e ->> 'outcome' = 'auth_expired');
    IF v_rejects THEN
        PERFORM credpool_lock_credentials(
            ARRAY(SELECT DISTINCT e ->> 'key_id' FROM jsonb_array_elements(p_releases) AS e
                  WHERE e ->> 'key_id' IS NOT NULL),
            false);
    END IF;
    PERFORM 1
    FROM lease_slots s
    WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_releases) AS e))
      AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid FROM jsonb_array_elements(p_releases) AS e))
    ORDER BY s.key_id, s.slot
    FOR UPDATE;
    -- their tenant slot rows (END clears them), right after the slot rows, before the windows
    PERFORM credpool_lock_tenant_slots(ARRAY(
        SELECT s FROM lease_slots s
        WHERE s.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_releases) AS e))
          AND s.lease_id = ANY (ARRAY(SELECT (e ->> 'lease_id')::uuid
                                      FROM jsonb_array_elements(p_releases) AS e))));
    PERFORM 1
    FROM lease_windows w
    WHERE w.key_id = ANY (ARRAY(SELECT e ->> 'key_id' FROM jsonb_array_elements(p_releases) AS e
                                WHERE e ->> 'usage_tokens' IS NOT NULL))
    ORDER BY w.key_id
    FOR UPDATE;
    -- the tenant_windows rows of the tenants of the leases named with a usage (their advisory
    -- locks held since the top)
    IF v_usage_tenants <> '{}' THEN
        PERFORM 1
        FROM tenant_windows tw
        WHERE tw.tenant_id = ANY (v_usage_tenants)
        ORDER BY tw.tenant_id
        FOR UPDATE;
    END IF;
    v_now := clock_timestamp();

    -- The verdicts, in one statement (the aggregates read its rows in request order). A lease
    -- named twice in one call is ended by the first request (in order) that names it by all of
    -- its values; the others find it gone.
    SELECT array_agg(j.n), array_agg(j.lease_id), array_agg(j.key_id), array_agg(j.provider),
           array_agg(j.pool), array_agg(j.fence), array_agg(j.outcome), array_agg(j.usage_tokens),
           array_agg(j.slot_row),
           array_agg(CASE
                         WHEN NOT j.authorized THEN 'unauthorized'
                         WHEN j.found AND j.matches AND j.nth = 1 THEN
                             CASE WHEN (j.slot_row).lease_until > v_now THEN 'released'
                                  ELSE 'expired' END
                         WHEN j.found AND NOT j.matches THEN 'mismatch'
                         ELSE 'not_found'
                     END)
    INTO v_n, v_lease, v_asked_key, v_provider, v_pool, v_fence, v_outcome, v_usage, v_slot,
         v_verdict
    FROM (
        SELECT w.n::integer AS n, w.lease_id, w.key_id, w.provider, w.pool, w.fence, w.outcome,
               w.usage_tokens, s AS slot_row, a.authorized,
               -- in a slot of the credential named, or (named with another key_id) of its own,
               -- which its `granted` row in the trail names
               s.lease_id IS NOT NULL
                   OR EXISTS (SELECT 1
                              FROM lease_events g
                              JOIN lease_slots o ON o.key_id = g.key_id AND o.lease_id = g.lease_id
                              WHERE g.lease_id = w.lease_id AND g.event = 'granted') AS found,
               coalesce(s.provider = w.provider AND s.pool = w.pool
                        AND (w.fence IS NULL OR s.fence = w.fence), false) AS matches,
               row_number() OVER (
                   PARTITION BY w.lease_id, a.authorized,
                                coalesce(s.provider = w.provider AND s.pool = w.pool
                                         AND (w.fence IS NULL OR s.fence = w.fence), false)
                   ORDER BY w.n) AS nth
        FROM ROWS FROM (jsonb_to_recordset(p_releases) AS (
                 lease_id uuid, key_id text, provider text, pool text, fence bigint, outcome text,
                 usage_tokens bigint, key_hash text))
             WITH ORDINALITY AS w (lease_id, key_id, provider, pool, fence, outcome, usage_tokens,
                                   key_hash, n)
        LEFT JOIN lease_slots s ON s.key_id = w.key_id AND s.lease_id = w.lease_id
        -- the key must be live (absent: the configured internal key, tenant `default`; read by
        -- this statement, so a release that starts after a revoke committed is refused) and of
        -- the lease's tenant: its slot row's, or (a lease no longer in the slot named) its
        -- `granted` row's (NULL there: granted before tenants existed, to `default`)
        LEFT JOIN LATERAL credpool_key_tenant(w.key_hash) AS k (tenant) ON true
        LEFT JOIN LATERAL (
            SELECT coalesce(g.tenant, 'default') AS tenant
            FROM lease_events g
            WHERE s.lease_id IS NULL AND g.lease_id = w.lease_id AND g.event = 'granted'
            LIMIT 1
        ) AS g ON true
        CROSS JOIN LATERAL (
            SELECT k.tenant IS NOT NULL
                   AND coalesce(s.tenant, g.tenant, k.tenant) = k.tenant AS authorized
        ) AS a
        ORDER BY w.n
    ) AS j;

    -- Every lease that ends, in one call: released now, or found expired in its slot.
    PERFORM credpool_end_leases(
        ARRAY(SELECT v_slot[k] FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        ARRAY(SELECT v_verdict[k] FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        ARRAY(SELECT CASE WHEN v_verdict[k] = 'released' THEN v_now ELSE (v_slot[k]).lease_until END
              FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        ARRAY(SELECT CASE WHEN v_verdict[k] = 'released' THEN v_outcome[k] END
              FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k),
        NULL,
        NULL,
        ARRAY(SELECT CASE WHEN v_verdict[k] = 'released' THEN v_usage[k] END
              FROM generate_subscripts(v_n, 1) AS k
              WHERE v_verdict[k] IN ('released', 'expired') ORDER BY k));

    -- What each did for health and the windows: a released outcome counts, and its usage replaces
    -- its reservation; an outcome or usage for a lease that had ended counts once, as a late
    -- report (after the ends above, so a release and a late report of one lease in one call
    -- meet the unique index in that order).
    v_key := array_fill(NULL::text, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_probe := array_fill(NULL::boolean, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_refit := v_probe; v_counted := v_probe;
    v_tenant_refit := array_fill(NULL::text, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_usage_at := array_fill(NULL::timestamptz, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_usage_delta := array_fill(NULL::bigint, ARRAY[coalesce(cardinality(v_n), 0)]);
    v_rejected_granted_at := v_usage_at;
    -- in ascending lease_id (the lock order of the trail's unique indexes: two groups reporting
    -- the same leases wait for each other's trail rows in one order)
    FOR i IN SELECT k FROM generate_subscripts(v_n, 1) AS k ORDER BY v_lease[k], k LOOP
        v_key[i] := CASE WHEN v_verdict[i] IN ('released', 'expired') THEN v_asked_key[i] END;
        v_probe[i] := v_verdict[i] = 'released' AND (v_slot[i]).probe;
        v_refit[i] := v_verdict[i] IN ('released', 'expired') AND (v_slot[i]).over_limit;
        IF v_verdict[i] IN ('released', 'expired') AND (v_slot[i]).tenant IS NOT NULL
           AND EXISTS (SELECT 1 FROM tenant_slots t
                       WHERE t.tenant_id = (v_slot[i]).tenant AND t.over_limit) THEN
            v_tenant_refit[i] := (v_slot[i]).tenant;
        END IF;
        v_counted[i] := v_verdict[i] = 'released' AND v_outcome[i] IS NOT NULL;
        v_usage_at[i] := NULL;
        v_usage_delta[i] := NULL;
        IF v_counted[i] AND v_outcome[i] = 'auth_expired' THEN
            v_rejected_granted_at[i] := (v_slot[i]).granted_at;
        END IF;
        IF v_verdict[i] = 'released' AND v_usage[i] IS NOT NULL THEN
            v_usage_at[i] := (v_slot[i]).granted_at;
            v_usage_delta[i] := v_usage[i] - coalesce((v_slot[i]).reserved_tokens, 0);
            PERFORM credpool_charge_usage(v_asked_key[i], (v_slot[i]).tenant, v_usage_at[i],
                                          v_usage_delta[i]);
        ELSIF v_verdict[i] IN ('expired', 'not_found')
              AND (v_outcome[i] IS NOT NULL OR v_usage[i] IS NOT NULL) THEN
            INSERT INTO lease_events
                (event, lease_id, key_id, provider, pool, slot, holder, outcome, lease_until, at,
                 tokens, tenant)
            SELECT 'outcome_after_expiry', g.lease_id, g.key_id, g.provider, g.pool, g.slot, g.holder,
                   v_outcome[i],
                   (SELECT max(e.lease_until) FROM lease_events e WHERE e.lease_id = v_lease[i]),
                   v_now, v_usage[i], g.tenant
            FROM lease_events g
            WHERE g.lease_id = v_lease[i] AND g.event = 'granted'
              AND g.key_id = v_asked_key[i] AND g.provider = v_provider[i] AND g.pool = v_pool[i]
              AND (v_fence[i] IS NULL OR g.fence IS NULL OR g.fence = v_fence[i])
            LIMIT 1
            ON CONFLICT (lease_id) WHERE event IN ('released', 'outcome_after_expiry') DO NOTHING
            RETURNING (SELECT g2.at FROM lease_events g2
                       WHERE g2.lease_id = v_lease[i] AND g2.event = 'granted' LIMIT 1) AS granted_at,
                      (SELECT g2.tokens FROM lease_events g2
                       WHERE g2.lease_id = v_lease[i] AND g2.event = 'granted' LIMIT 1) AS reserved,
                      tenant
            INTO v_late;
            IF FOUND THEN
                v_key[i] := v_asked_key[i];
                v_counted[i] := v_outcome[i] IS NOT NULL;
                IF v_outcome[i] = 'auth_expired' THEN
                    v_rejected_granted_at[i] := v_late.granted_at;
                END IF;
                IF v_usage[i] IS NOT NULL THEN
                    v_usage_at[i] := v_late.granted_at;
                    v_usage_delta[i] := v_usage[i] - coalesce(v_late.reserved, 0);
                    PERFORM credpool_charge_usage(v_asked_key[i], v_late.tenant, v_usage_at[i],
                                                  v_usage_delta[i]);
                END IF;
            END IF;
        END IF;
    END LOOP;

    -- The credential rows of counted outcomes (lock order 4: after the trail rows), for the
    -- health write; FOR UPDATE with an `auth_expired` report, the strength
    -- credpool_lock_credentials takes for a write of the token (every credential whose token a
    -- report rejects has a counted outcome).
    v_counted_keys := ARRAY(SELECT k FROM unnest(v_key, v_counted) AS x (k, counted) WHERE x.counted);
    IF v_rejects THEN
        PERFORM 1 FROM credentials c WHERE c.key_id = ANY (v_counted_keys) ORDER BY c.key_id FOR UPDATE;
    ELSE
        PERFORM 1 FROM credentials c WHERE c.key_id = ANY (v_counted_keys) ORDER BY c.key_id
        FOR NO KEY UPDATE;
    END IF;
    v_health_now := clock_timestamp();

    -- `auth_expired` on a lease of the current generation (granted at or after the generation
    -- began; the credentials' operator locks and slot rows are held since the top, so no refresh
    -- or PUT is writing meanwhile, and their rows since the statement above): the token counts
    -- as expired from now, so no claim grants it again (credpool_token_lasts, gated by
    -- config_version) and the refresher finds it due at once, which refreshes it exactly once
    -- however many reports arrive (the refresh is taken per generation, service/src/oauth.rs).
    -- A report on a lease of an older generation says nothing about the current token.
    IF v_rejects THEN
        WITH rejected AS (
            SELECT DISTINCT ON (x.key_id) x.key_id, x.lease_id, o.generation
            FROM unnest(v_key, v_lease, v_rejected_granted_at) AS x (key_id, lease_id, granted_at)
            JOIN oauth_credentials o ON o.key_id = x.key_id
            WHERE x.granted_at >= o.generation_at
            ORDER BY x.key_id, x.granted_at
        ),
        expired AS (
            UPDATE credentials c
            SET token_expires_at = v_now
            FROM rejected r
            WHERE c.key_id = r.key_id AND c.token_expires_at > v_now
            RETURNING c.key_id
        )
        INSERT INTO credential_events (key_id, event, reason, lease_id, actor, details, at)
        SELECT r.key_id, 'token_rejected',
               'auth_expired reported: the provider rejected the access token; refresh due now',
               r.lease_id, 'executor', jsonb_build_object('generation', r.generation), v_now
        FROM rejected r
        JOIN expired e ON e.key_id = r.key_id;
    END IF;

    RETURN QUERY
    SELECT v.n, v.verdict, v.key_id, v.probe, v.refit, v.tenant_refit, v.usage_at, v.usage_delta,
           v.counted AND c.key_id IS NOT NULL,
           c.status, c.status_reason, c.cooldown_until, c.health_successes, c.health_failures,
           c.health_rate_limits, c.health_decayed_at, c.recent_failures, c.cooldowns_in_a_row,
           c.last_success_at, c.recovered_at, v_health_now, c.token_expires_at IS NOT NULL
    FROM unnest(v_n, v_verdict, v_key, v_probe, v_refit, v_counted, v_usage_at, v_usage_delta,
                v_tenant_refit)
         AS v (n, verdict, key_id, probe, refit, counted, usage_at, usage_delta, tenant_refit)
    LEFT JOIN credentials c ON c.key_id = v.key_id AND v.counted
    ORDER BY v.n;
END;
$$;

-- HEALTH: writes the health that applying outcome reports produced (service/src/allocator/health.rs computes it
-- from the rows credpool_release returned) and the status transitions to credential_events, in
-- one statement. p_next: [{"key_id", "status", "status_reason", "cooldown_until",
-- "health_successes", "health_failures", "health_rate_limits", "health_decayed_at",
-- "recent_failures", "cooldowns_in_a_row", "last_success_at", "recovered_at"}]; p_transitions:
-- [{"key_id", "old_status", "new_status", "reason", "cooldown_until", "lease_id", "at", "actor"
-- (whose report: `tenant:<id>`), "details" (the report: tenant, outcome, a clamped retry_after)}]. The
-- caller holds the credential rows' locks (credpool_release took them, ascending key_id). A
-- credential deleted meanwhile is skipped, with its transitions.
CREATE OR REPLACE FUNCTION credpool_write_health(p_next jsonb, p_transitions jsonb) RETURNS integer
LANGUAGE plpgsql
SET credpool.health_write = 'on'
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off SET enable_material = off SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_updated integer;
BEGIN
    WITH next AS (
        SELECT *
        FROM jsonb_to_recordset(p_next) AS n (
            key_id text, status text, status_reason text, cooldown_until timestamptz,
            health_successes double precision, health_failures double precision,
            health_rate_limits double precision, health_decayed_at timestamptz,
            recent_failures timestamptz[], cooldowns_in_a_row integer,
            last_success_at timestamptz, recovered_at timestamptz)
    ),
    updated AS (
        UPDATE credentials c
        SET status = n.status, status_reason = n.status_reason,
            cooldown_until = n.cooldown_until, health_successes = n.health_successes,
            health_failures = n.health_failures, health_rate_limits = n.health_rate_limits,
            health_decayed_at = n.health_decayed_at, recent_failures = n.recent_failures,
            cooldowns_in_a_row = n.cooldowns_in_a_row, last_success_at = n.last_success_at,
            recovered_at = n.recovered_at
        FROM next n
        WHERE c.key_id = n.key_id
        RETURNING c.key_id
    ),
    transitions AS (
        INSERT INTO credential_events
            (key_id, event, old_status, new_status, reason, cooldown_until, lease_id, at, actor,
             details)
        SELECT t.key_id, 'status_changed', t.old_status, t.new_status, t.reason, t.cooldown_until,
               t.lease_id, coalesce(t.at, statement_timestamp()), t.actor, t.details
        FROM jsonb_to_recordset(p_transitions) AS t (
            key_id text, old_status text, new_status text, reason text,
            cooldown_until timestamptz, lease_id uuid, at timestamptz, actor text, details jsonb)
        WHERE t.key_id IN (SELECT key_id FROM updated)
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_updated FROM updated;
    RETURN v_updated;
END;
$$;

-- What a new window of `p_kind` and `p_seconds` has counted at `p_now`, from the trail: the
-- grants of credential `p_key_id` (or, when it is NULL, of tenant `p_tenant`) in the buckets it
-- counts (a grant's tokens: the usage its release reported, else its reservation), as the 17
-- bucket numbers and charges of its ring (an empty bucket holds number 0, older than any).
DROP FUNCTION IF EXISTS credpool_seed_window(text, text, integer, timestamptz);
CREATE OR REPLACE FUNCTION credpool_seed_window(
    p_key_id text, p_tenant text, p_kind text, p_seconds integer, p_now timestamptz,
    OUT ids bigint[], OUT charged bigint[])
LANGUAGE sql STABLE AS $$
    WITH recent AS (
        -- (two branches, one run: a credential's grants through its (key_id, at) index)
        SELECT g.lease_id, g.at, g.tokens FROM lease_events g
        WHERE p_key_id IS NOT NULL AND g.key_id = p_key_id AND g.event = 'granted'
          AND g.at >= p_now - make_interval(secs => p_seconds * 17.0 / 16)
        UNION ALL
        SELECT g.lease_id, g.at, g.tokens FROM lease_events g
        WHERE p_key_id IS NULL AND g.tenant = p_tenant AND g.event = 'granted'
          AND g.at >= p_now - make_interval(secs => p_seconds * 17.0 / 16)
    ),
    grants AS (
        SELECT credpool_window_bucket(g.at, p_seconds) AS bucket,
               CASE p_kind WHEN 'requests' THEN 1
                   ELSE coalesce((SELECT e.tokens FROM lease_events e
                                  WHERE e.lease_id = g.lease_id AND e.tokens IS NOT NULL
                                    AND e.event IN ('released', 'outcome_after_expiry')
                                  LIMIT 1), g.tokens, 0) END AS amount
        FROM recent g
    ),
    buckets AS (
        SELECT bucket, sum(amount)::bigint AS amount
        FROM grants
        WHERE bucket >= credpool_window_bucket(p_now, p_seconds) - 16
        GROUP BY bucket
    )
    SELECT array_agg(coalesce(b.bucket, 0) ORDER BY ring.slot),
           array_agg(coalesce(b.amount, 0) ORDER BY ring.slot)
    FROM generate_series(0, 16) AS ring (slot)
    LEFT JOIN buckets b ON b.bucket % 17 = ring.slot
$$;

-- Windows `p_old` brought in line with `p_rate_limits` at `p_now`: a window kept (same kind and
-- length) keeps its buckets, whatever its count; a new one is seeded from the trail of credential
-- `p_key_id` (or, when it is NULL, of tenant `p_tenant`): credpool_seed_window. `p_old` unchanged
-- when the configuration is.
CREATE OR REPLACE FUNCTION credpool_windows_fitted(p_old lease_windows, p_rate_limits jsonb,
    p_key_id text, p_tenant text, p_now timestamptz)
RETURNS lease_windows
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_new lease_windows := p_old;
    v_config record;
    v_seed record;
    v_kept integer;
BEGIN
    v_config := credpool_window_config(p_rate_limits);
    IF (p_old.window_kinds, p_old.window_counts, p_old.window_seconds)
       IS NOT DISTINCT FROM (v_config.kinds, v_config.counts, v_config.seconds) THEN
        RETURN p_old;
    END IF;
    v_new.window_kinds := v_config.kinds;
    v_new.window_counts := v_config.counts;
    v_new.window_seconds := v_config.seconds;
    v_new.bucket_ids := '{}';
    v_new.bucket_charged := '{}';
    FOR i IN 1 .. coalesce(cardinality(v_config.kinds), 0) LOOP
        v_kept := NULL;
        FOR j IN 1 .. coalesce(cardinality(p_old.window_kinds), 0) LOOP
            IF p_old.window_kinds[j] = v_config.kinds[i]
               AND p_old.window_seconds[j] = v_config.seconds[i] THEN
                v_kept := j;
                EXIT;
            END IF;
        END LOOP;
        IF v_kept IS NOT NULL THEN
            v_new.bucket_ids := v_new.bucket_ids || p_old.bucket_ids[(v_kept - 1) * 17 + 1 : v_kept * 17];
            v_new.bucket_charged := v_new.bucket_charged
                || p_old.bucket_charged[(v_kept - 1) * 17 + 1 : v_kept * 17];
        ELSE
            v_seed := credpool_seed_window(p_key_id, p_tenant, v_config.kinds[i], v_config.seconds[i], p_now);
            v_new.bucket_ids := v_new.bucket_ids || v_seed.ids;
            v_new.bucket_charged := v_new.bucket_charged || v_seed.charged;
        END IF;
    END LOOP;
    RETURN v_new;
END;
$$;

-- Brings a credential's lease_windows row in line with its rate_limits (see credpool_fit_slots,
-- which calls it holding the row's lock). Returns whether the credential has windows.
CREATE OR REPLACE FUNCTION credpool_fit_windows(p_key_id text, p_rate_limits jsonb, p_now timestamptz)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_old lease_windows;
    v_new lease_windows;
BEGIN
    SELECT * INTO v_old FROM lease_windows WHERE key_id = p_key_id;
    IF NOT FOUND THEN
        INSERT INTO lease_windows (key_id) VALUES (p_key_id) RETURNING * INTO v_old;
    END IF;
    v_new := credpool_windows_fitted(v_old, p_rate_limits, p_key_id, NULL, p_now);
    IF v_new IS DISTINCT FROM v_old THEN
        UPDATE lease_windows
        SET window_kinds = v_new.window_kinds, window_counts = v_new.window_counts,
            window_seconds = v_new.window_seconds, bucket_ids = v_new.bucket_ids,
            bucket_charged = v_new.bucket_charged
        WHERE key_id = p_key_id;
    END IF;
    RETURN cardinality(v_new.window_kinds) > 0;
END;
$$;

-- Brings a tenant's tenant_windows row in line with its rate_limits (credpool_fit_tenant calls
-- it holding the tenant's advisory lock): a tenant with windows has its row, one without none.
CREATE OR REPLACE FUNCTION credpool_fit_tenant_windows(p_tenant_id text, p_rate_limits jsonb,
    p_now timestamptz)
RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_old lease_windows;
    v_new lease_windows;
BEGIN
    SELECT (credpool_tenant_window(tw)).* INTO v_old
    FROM tenant_windows tw WHERE tw.tenant_id = p_tenant_id FOR UPDATE;
    IF NOT FOUND THEN
        v_old := ROW(p_tenant_id, '{}', '{}', '{}', '{}', '{}')::lease_windows;
    END IF;
    v_new := credpool_windows_fitted(v_old, p_rate_limits, NULL, p_tenant_id, p_now);
    IF cardinality(v_new.window_kinds) = 0 THEN
        DELETE FROM tenant_windows WHERE tenant_id = p_tenant_id;
    ELSIF v_new IS DISTINCT FROM v_old THEN
        INSERT INTO tenant_windows AS tw (tenant_id, window_kinds, window_counts, window_seconds,
                                          bucket_ids, bucket_charged)
        VALUES (p_tenant_id, v_new.window_kinds, v_new.window_counts, v_new.window_seconds,
                v_new.bucket_ids, v_new.bucket_charged)
        ON CONFLICT ON CONSTRAINT tenant_windows_pkey DO UPDATE
        SET window_kinds = EXCLUDED.window_kinds, window_counts = EXCLUDED.window_counts,
            window_seconds = EXCLUDED.window_seconds, bucket_ids = EXCLUDED.bucket_ids,
            bucket_charged = EXCLUDED.bucket_charged;
    END IF;
END;
$$;

-- FIT: brings a credential's slot rows in line with its max_concurrent_uses, its drain state and
-- its rate windows, in the caller's transaction. Called after every change of the limit, of
-- draining or of the windows, after a release freed a slot that was over a lowered limit, and by
-- the cleanup pass for credentials back under their limit.
--
-- Locks, in the lock order (credpool_lock_credentials): every slot row of the credential,
-- ascending slot, then its lease_windows row, then the credential row. The in-flight count is
-- exact: it is taken after the locks, on clock_timestamp() read after them, and nobody else can
-- fill or free a slot while they are held.
--
-- Afterwards, with in-flight <= limit: the slot rows are exactly 0..limit-1, every live lease sits
-- in one of them (a lease at or above the new limit moves into a free lower number: its slot's
-- key changes by UPDATE, so a release or renewal waiting for the row follows it), no slot is over
-- the limit. With in-flight > limit (lowered under load): every free slot row is deleted and
-- every remaining one is marked over_limit; the `limit` rows whose leases end last stay within
-- the limit, the others are `surplus` (never claimed; gone at the next fit). A row within the
-- limit reopens to claims on its own when its lease ends (expiry on the database clock: nothing
-- has to run), and exactly back up to the limit: every surplus lease ends no later than every
-- lease within the limit (ranked so here; RENEW caps a surplus lease at them; END closes a row
-- within the limit that frees while a surplus lease is held), so when k of those rows have
-- reopened, at most limit - k leases count. Lowering the limit revokes nothing. Either way every
-- slot row carries the credential's `draining`, `windowed` (it has rate windows) and
-- configuration version. Expired leases found on the way are ended (`expired`). A change of the
-- over-limit state moves the pool's version.
--
-- Windows: the lease_windows row follows the credential's rate_limits. A window kept (same kind
-- and length) keeps what it counted; a new one starts from the trail (the grants of its last
-- length, with their usage where a release reported one, else their reservation), so a window set
-- on a busy credential holds at once.
CREATE OR REPLACE FUNCTION credpool_fit_slots(p_key_id text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_limit integer;
    v_draining boolean;
    v_provider text;
    v_pool text;
    v_version bigint;
    v_now timestamptz;
    v_live integer;
    v_was_over boolean;
    v_rate_limits jsonb;
    v_windowed boolean;
BEGIN
    IF credpool_lock_credentials(ARRAY[p_key_id]) = 0 THEN
        RETURN;
    END IF;
    SELECT max_concurrent_uses, draining, provider, pool, rate_limits, config_version
    INTO v_limit, v_draining, v_provider, v_pool, v_rate_limits, v_version
    FROM credentials WHERE key_id = p_key_id;
    PERFORM credpool_test_hook('fit.locked');
    v_now := clock_timestamp();
    v_windowed := credpool_fit_windows(p_key_id, v_rate_limits, v_now);

    PERFORM credpool_end_leases(array_agg(s ORDER BY s.slot), array_agg('expired'::text),
                                array_agg(s.lease_until ORDER BY s.slot))
    FROM lease_slots s
    WHERE s.key_id = p_key_id AND s.lease_id IS NOT NULL AND s.lease_until <= v_now;

    SELECT count(*) FILTER (WHERE lease_id IS NOT NULL), coalesce(bool_or(over_limit), false)
    INTO v_live, v_was_over
    FROM lease_slots WHERE key_id = p_key_id;

    IF v_live > v_limit THEN
        DELETE FROM lease_slots WHERE key_id = p_key_id AND lease_id IS NULL;
        UPDATE lease_slots s
        SET over_limit = true, surplus = r.rank > v_limit, draining = v_draining,
            windowed = v_windowed, config_version = v_version
        FROM (SELECT slot, row_number() OVER (ORDER BY lease_until DESC, slot) AS rank
              FROM lease_slots WHERE key_id = p_key_id) AS r
        WHERE s.key_id = p_key_id AND s.slot = r.slot
          AND (NOT s.over_limit OR s.surplus IS DISTINCT FROM (r.rank > v_limit)
               OR s.draining IS DISTINCT FROM v_draining OR s.windowed IS DISTINCT FROM v_windowed
               OR s.config_version IS DISTINCT FROM v_version);
        IF NOT v_was_over THEN
            PERFORM credpool_bump_pool_version(v_provider, v_pool);
        END IF;
        PERFORM credpool_test_hook('fit.done');
        RETURN;
    END IF;

    -- Numbers below the limit that no live lease holds, lowest first, paired with the live leases
    -- at or above the limit: the free rows there make way, the leases move in.
    WITH movers AS (
        SELECT slot, row_number() OVER (ORDER BY slot) AS n
        FROM lease_slots
        WHERE key_id = p_key_id AND slot >= v_limit AND lease_id IS NOT NULL
    ),
    targets AS (
        SELECT g AS slot, row_number() OVER (ORDER BY g) AS n
        FROM generate_series(0, v_limit - 1) AS g
        WHERE NOT EXISTS (SELECT 1 FROM lease_slots s
                          WHERE s.key_id = p_key_id AND s.slot = g AND s.lease_id IS NOT NULL)
    )
    DELETE FROM lease_slots s
    USING movers JOIN targets USING (n)
    WHERE s.key_id = p_key_id AND s.slot = targets.slot AND s.lease_id IS NULL;

    WITH movers AS (
        SELECT slot, row_number() OVER (ORDER BY slot) AS n
        FROM lease_slots
        WHERE key_id = p_key_id AND slot >= v_limit AND lease_id IS NOT NULL
    ),
    targets AS (
        SELECT g AS slot, row_number() OVER (ORDER BY g) AS n
        FROM generate_series(0, v_limit - 1) AS g
        WHERE NOT EXISTS (SELECT 1 FROM lease_slots s
                          WHERE s.key_id = p_key_id AND s.slot = g AND s.lease_id IS NOT NULL)
    )
    UPDATE lease_slots s
    SET slot = targets.slot
    FROM movers JOIN targets USING (n)
    WHERE s.key_id = p_key_id AND s.slot = movers.slot;

    DELETE FROM lease_slots WHERE key_id = p_key_id AND slot >= v_limit;
    INSERT INTO lease_slots (key_id, slot, draining, windowed, config_version)
    SELECT p_key_id, g, v_draining, v_windowed, v_version FROM generate_series(0, v_limit - 1) AS g
    ON CONFLICT ON CONSTRAINT lease_slots_pkey DO NOTHING;
    UPDATE lease_slots
    SET over_limit = false, surplus = false, draining = v_draining, windowed = v_windowed,
        config_version = v_version
    WHERE key_id = p_key_id
      AND (over_limit OR draining IS DISTINCT FROM v_draining OR windowed IS DISTINCT FROM v_windowed
           OR config_version IS DISTINCT FROM v_version);
    IF v_was_over THEN
        PERFORM credpool_bump_pool_version(v_provider, v_pool);
    END IF;
    PERFORM credpool_test_hook('fit.done');
END;
$$;

-- FORCE RELEASE: an operator ends leases: one (p_lease_id), or every live lease of a credential
-- (p_key_id), each as `force_released` with the operator's reason and name. Returns the leases
-- ended. Locks the whole credential first (credpool_lock_credentials: every slot row, the windows
-- row, the credential row), so that a credential over a lowered limit is refitted in the same
-- transaction and reopens at once. Decision clock: clock_timestamp() after the locks (`at` of the
-- trail rows).
DROP FUNCTION IF EXISTS credpool_force_release(text, uuid, text, text);
CREATE FUNCTION credpool_force_release(p_key_id text, p_lease_id uuid, p_reason text, p_actor text)
RETURNS TABLE (lease_id uuid, key_id text, holder text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_key text := p_key_id;
    v_now timestamptz;
    v_slots lease_slots[];
    v_ended uuid[];
BEGIN
    IF v_key IS NULL THEN
        -- the lease's credential, when not given: its `granted` row in the trail names it
        SELECT g.key_id INTO v_key
        FROM lease_events g WHERE g.lease_id = p_lease_id AND g.event = 'granted' LIMIT 1;
    END IF;
    IF v_key IS NULL OR credpool_lock_credentials(ARRAY[v_key]) = 0 THEN
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_slots := ARRAY(SELECT s FROM lease_slots s
                     WHERE s.key_id = v_key AND s.lease_id IS NOT NULL AND s.lease_until > v_now
                       AND (p_lease_id IS NULL OR s.lease_id = p_lease_id)
                     ORDER BY s.slot);
    v_ended := credpool_end_leases(
        v_slots,
        array_fill('force_released'::text, ARRAY[cardinality(v_slots)]),
        array_fill(v_now, ARRAY[cardinality(v_slots)]),
        NULL,
        array_fill(p_reason, ARRAY[cardinality(v_slots)]),
        array_fill(p_actor, ARRAY[cardinality(v_slots)]));
    IF EXISTS (SELECT 1 FROM unnest(v_slots) AS x WHERE x.over_limit) THEN
        PERFORM credpool_fit_slots(v_key);
    END IF;
    RETURN QUERY
    SELECT x.lease_id, x.key_id, x.holder
    FROM unnest(v_slots) AS x
    WHERE x.lease_id = ANY (v_ended)
    ORDER BY x.slot;
END;
$$;

-- REAP: ends up to p_batch expired leases (`expired`, at their own lease_until) and frees their
-- slots. Correctness never depends on it (a claim treats an expired lease as free and reuses its
-- slot); it keeps the trail complete and "leases in flight" honest. Takes slot rows with SKIP
-- LOCKED, deciding on statement_timestamp(); END then takes the leases' tenant rows (lock order
-- 1b), which it may wait for while a claim that locked one commits (milliseconds). Leaves the rows within a lowered limit (over_limit, not
-- surplus) to claims and to REFIT: ended here, END would close them while a surplus row still
-- holds its (expired) lease. Returns how many leases it ended.
CREATE OR REPLACE FUNCTION credpool_reap_expired_leases(p_batch integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_slots lease_slots[];
BEGIN
    SELECT array_agg(locked.s ORDER BY (locked.s).key_id, (locked.s).slot) INTO v_slots
    FROM (SELECT s
          FROM lease_slots s
          WHERE s.lease_id IS NOT NULL AND s.lease_until <= statement_timestamp()
            AND (s.surplus OR NOT s.over_limit)
          ORDER BY s.lease_until
          LIMIT p_batch
          FOR UPDATE SKIP LOCKED) AS locked;
    IF v_slots IS NULL THEN
        RETURN 0;
    END IF;
    RETURN cardinality(credpool_end_leases(
        v_slots,
        array_fill('expired'::text, ARRAY[cardinality(v_slots)]),
        ARRAY(SELECT x.lease_until FROM unnest(v_slots) AS x)));
END;
$$;

-- REFIT, in the cleanup pass: fits the slots of up to p_batch credentials that are over a lowered
-- limit with fewer leases in flight than the limit (their releases normally refit them at once;
-- this catches a service that stopped in between, and removes the surplus rows once their leases
-- have ended). Never waits: a credential whose slot rows or row another transaction holds is left
-- for the next pass (its rows within the limit reopen on their own meanwhile).
-- Returns how many credentials it fitted.
CREATE OR REPLACE FUNCTION credpool_refit_over_limit(p_batch integer DEFAULT 100) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_fitted integer := 0;
    r record;
BEGIN
    FOR r IN
        SELECT c.key_id
        FROM credentials c
        WHERE EXISTS (SELECT 1 FROM lease_slots s WHERE s.key_id = c.key_id AND s.over_limit)
          AND (SELECT count(*) FROM lease_slots s
               WHERE s.key_id = c.key_id AND s.lease_id IS NOT NULL
                 AND s.lease_until > statement_timestamp()) < c.max_concurrent_uses
        ORDER BY c.key_id
        LIMIT p_batch
    LOOP
        -- all or nothing, without waiting: the operator lock (before any row: FIT takes it), every
        -- slot row, the windows row and the credential row, or skip it
        IF pg_try_advisory_xact_lock(credpool_operator_lock(r.key_id))
           AND (SELECT count(*) FROM (SELECT 1 FROM lease_slots s WHERE s.key_id = r.key_id
                                  ORDER BY s.slot FOR UPDATE SKIP LOCKED) locked)
           = (SELECT count(*) FROM lease_slots s WHERE s.key_id = r.key_id)
           AND (SELECT count(*) FROM (SELECT 1 FROM lease_windows w WHERE w.key_id = r.key_id
                                      FOR UPDATE SKIP LOCKED) locked)
               = (SELECT count(*) FROM lease_windows w WHERE w.key_id = r.key_id)
           AND EXISTS (SELECT 1 FROM credentials c WHERE c.key_id = r.key_id FOR UPDATE SKIP LOCKED)
        THEN
            PERFORM credpool_fit_slots(r.key_id);
            v_fitted := v_fitted + 1;
        END IF;
    END LOOP;
    RETURN v_fitted;
END;
$$;

-- FIT TENANT: brings tenant `p_tenant_id`'s slot rows in line with its cap
-- (max_concurrent_leases), and its tenant_windows row with its rate_limits
-- (credpool_fit_tenant_windows), in the caller's transaction. Called by an operator's PUT of the
-- tenant, after a release ended a lease of a tenant over a lowered cap (in a transaction of its
-- own, once the release committed), and by the cleanup pass.
--
-- Invariant kept: a capped tenant's live leases never exceed its cap at a grant. Capacity is the
-- set of its tenant_slots rows a claim may take (not over_limit); every live lease of the tenant
-- sits in one row. Afterwards, with `live` leases in flight (counted after the locks, on
-- clock_timestamp()): free rows are deleted; if live <= cap, every row is open and cap - live
-- free rows are added, so exactly cap leases may be held; if live > cap (lowered under load),
-- every row is over_limit: the tenant grants nothing until a fit finds it back under its cap
-- (a release of its leases refits it at once; an expiry, the next cleanup pass). Lowering a
-- cap revokes nothing. A tenant without a cap keeps no rows (its claims take none).
--
-- A tenant given a cap while it holds leases (none of them in rows: it had no cap) adopts them:
-- their slot rows are locked first (lock order: slot rows, then tenant rows), so none of them
-- ends or is renewed unseen, and each gets a row. A claim in flight holds the tenant's advisory
-- lock in shared mode until it commits, so its lease is among them (CLAIM, "Tenants").
--
-- Locks: the tenant's advisory lock (one fit of a tenant at a time: rows are only inserted and
-- deleted here; claims of the tenant hold it in shared mode, tried), then (adopting) the slot
-- rows of its leases, then every tenant_slots row of it, ascending slot, then its
-- tenant_windows row.
CREATE OR REPLACE FUNCTION credpool_fit_tenant(p_tenant_id text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_cap integer;
    v_rate_limits jsonb;
    v_now timestamptz;
    v_live integer;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('credpool.tenant:' || p_tenant_id, 0));
    SELECT max_concurrent_leases, rate_limits INTO v_cap, v_rate_limits
    FROM tenants WHERE tenant_id = p_tenant_id;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_cap IS NOT NULL AND NOT EXISTS (SELECT 1 FROM tenant_slots WHERE tenant_id = p_tenant_id) THEN
        PERFORM 1 FROM lease_slots s
        WHERE s.tenant = p_tenant_id AND s.lease_id IS NOT NULL
        ORDER BY s.key_id, s.slot
        FOR UPDATE;
        -- (each adopted lease names its row on its slot row, as a grant's does)
        WITH adopted AS (
            INSERT INTO tenant_slots (tenant_id, slot, lease_id, key_id, lease_until)
            SELECT p_tenant_id, (row_number() OVER (ORDER BY s.key_id, s.slot) - 1)::integer,
                   s.lease_id, s.key_id, s.lease_until
            FROM lease_slots s
            WHERE s.tenant = p_tenant_id AND s.lease_id IS NOT NULL
              AND s.lease_until > clock_timestamp()
            RETURNING slot, lease_id, key_id
        )
        UPDATE lease_slots s
        SET tenant_slot = a.slot
        FROM adopted a
        WHERE s.key_id = a.key_id AND s.lease_id = a.lease_id;
    END IF;
    PERFORM 1 FROM tenant_slots t WHERE t.tenant_id = p_tenant_id ORDER BY t.slot FOR UPDATE;
    -- its windows, after its slot rows (the lock order): the row is taken by claims (with SKIP
    -- LOCKED, never waited for) and by releases reporting usage, for the milliseconds of their
    -- statements
    PERFORM credpool_fit_tenant_windows(p_tenant_id, v_rate_limits, clock_timestamp());
    v_now := clock_timestamp();
    IF v_cap IS NULL THEN
        DELETE FROM tenant_slots WHERE tenant_id = p_tenant_id;
        RETURN;
    END IF;
    DELETE FROM tenant_slots
    WHERE tenant_id = p_tenant_id AND (lease_id IS NULL OR lease_until <= v_now);
    SELECT count(*)::integer INTO v_live FROM tenant_slots WHERE tenant_id = p_tenant_id;
    UPDATE tenant_slots SET over_limit = (v_live > v_cap)
    WHERE tenant_id = p_tenant_id AND over_limit IS DISTINCT FROM (v_live > v_cap);
    INSERT INTO tenant_slots (tenant_id, slot)
    SELECT p_tenant_id, g
    FROM generate_series(0, v_cap + v_live) AS g
    WHERE NOT EXISTS (SELECT 1 FROM tenant_slots t WHERE t.tenant_id = p_tenant_id AND t.slot = g)
    ORDER BY g
    LIMIT greatest(v_cap - v_live, 0);
END;
$$;

-- A tenant's leases in flight now (live: lease_until after the clock) and its cap, for the admin
-- list: every lease of the tenant, capped or not, read from the slot rows (a tenant's usage is a
-- read, not a decision: the claim decides on tenant_slots).
CREATE OR REPLACE VIEW tenant_usage AS
SELECT t.tenant_id, t.max_concurrent_leases, t.weight, t.rate_limits,
       (SELECT count(*) FROM lease_slots s
        WHERE s.tenant = t.tenant_id AND s.lease_id IS NOT NULL AND s.lease_until > now()) AS in_flight,
       (SELECT count(*) FROM tenant_keys k WHERE k.tenant_id = t.tenant_id AND k.revoked_at IS NULL)
           AS live_keys,
       t.created_at, t.updated_at
FROM tenants t;

-- REFIT TENANTS, in the cleanup pass: fits up to p_batch tenants over a lowered cap (their
-- releases refit them at once; this catches leases that expired instead, and a service that
-- stopped in between). A tenant whose advisory lock another transaction holds (an operator's
-- change; a claim of the tenant, in shared mode, for the milliseconds of its transaction) is left
-- for the next pass: waiting for it while holding the rows of a tenant fitted before would break
-- the lock order. The fit waits only for tenant rows a claim, renewal or release holds for the
-- milliseconds of its statement. Returns how many tenants it fitted.
CREATE OR REPLACE FUNCTION credpool_refit_tenants(p_batch integer DEFAULT 100) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_fitted integer := 0;
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT t.tenant_id FROM tenant_slots t WHERE t.over_limit
        ORDER BY t.tenant_id LIMIT p_batch
    LOOP
        IF pg_try_advisory_xact_lock(hashtextextended('credpool.tenant:' || r.tenant_id, 0)) THEN
            PERFORM credpool_fit_tenant(r.tenant_id);
            v_fitted := v_fitted + 1;
        END IF;
    END LOOP;
    RETURN v_fitted;
END;
$$;

-- Upgrading to tenant windows (migration 20261203000016), once the functions above are in place,
-- in the transaction that puts them there; nothing to do on a later run. Leases in flight of
-- capped tenants name their tenant slot rows (lease_slots.tenant_slot); tenants given windows
-- before windows were enforced get their tenant_windows rows, seeded from the trail like a window
-- set now (credpool_fit_tenant, under the tenant's advisory lock).
UPDATE lease_slots s
SET tenant_slot = t.slot
FROM tenant_slots t
WHERE t.tenant_id = s.tenant AND t.lease_id = s.lease_id AND s.tenant_slot IS DISTINCT FROM t.slot;
SELECT credpool_fit_tenant(t.tenant_id)
FROM tenants t
WHERE t.rate_limits <> '[]'::jsonb
  AND NOT EXISTS (SELECT 1 FROM tenant_windows w WHERE w.tenant_id = t.tenant_id);
