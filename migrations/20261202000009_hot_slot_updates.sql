-- A grant and an end of a lease update its slot row in place, twice per lease. With an index on
-- a column those updates change (lease_id, lease_until), each one writes a new entry in every
-- index of the table, and most of the WAL a lease costs was such entries. Without one, and with
-- room on the row's page for its next version, they are heap-only (HOT) updates: no index entry,
-- less WAL, no index bloat for vacuum to catch up with.
--
-- A lease is found through its credential instead (key_id, the primary key's prefix): every
-- executor call names it, request ids record it (below), and the trail's lease_id index gives it
-- for the rare call that names a lease without its credential. The reaper reads the slots table
-- whole, once a pass.

-- Request ids name the credential of their lease, so a retry finds its lease by (key_id,
-- lease_id). Rows of leases that have ended keep NULL: they are only storage, and the cleanup
-- pass deletes them.
ALTER TABLE lease_requests ADD COLUMN key_id text;
UPDATE lease_requests r
SET key_id = s.key_id
FROM lease_slots s
WHERE s.lease_id = r.lease_id;

DROP INDEX lease_slots_lease_id_key;
DROP INDEX lease_slots_lease_until_idx;

-- Room on each page for the next versions of its rows, rewritten now so that the rows already
-- there get it too. Under load a page cannot always be pruned at once (another backend has it
-- pinned), so one version of room per row is not enough: at 50, a third of the updates of a
-- 64-executor benchmark were still not heap-only; at 25, all of them were.
ALTER TABLE lease_slots SET (fillfactor = 25);
CLUSTER lease_slots USING lease_slots_pkey;
