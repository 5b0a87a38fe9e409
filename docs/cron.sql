-- Scheduling credpool's cleanup with pg_cron, for DBAs who apply it themselves.
-- (`credpool cron install` does the same; `credpool cron uninstall` undoes it.)
--
-- Requirements:
--   * pg_cron installed (Debian: apt-get install postgresql-15-cron) and preloaded:
--       shared_preload_libraries = 'pg_cron'     (postgresql.conf; restart PostgreSQL)
--   * cron.database_name names the database pg_cron lives in (default: postgres). The extension
--     can only be created there. Jobs for credpool's database are scheduled from there with
--     cron.schedule_in_database. If credpool's database IS cron.database_name, the same works.
--   * pg_cron runs jobs by connecting to the server; the job's user needs to be able to connect
--     to credpool's database. The job is a CALL of a procedure that commits after each step, which
--     needs that mode: with cron.use_background_workers = on, pg_cron cannot run it (a procedure
--     there may not commit), so let `credpool serve` run the cleanup instead.
--
-- Replace credpool_db with credpool's database name, and 30 days with your audit retention.

-- 1. In the database named by cron.database_name:
CREATE EXTENSION IF NOT EXISTS pg_cron;

SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname = 'credpool:credpool_db:maintenance';
SELECT cron.schedule_in_database(
    'credpool:credpool_db:maintenance',
    '* * * * *',                                    -- every minute
    'CALL credpool_maintenance(make_interval(secs => 2592000))',   -- 30 days
    'credpool_db');

-- 2. In credpool's database: tell the credpool services that pg_cron runs the cleanup, so they stop
--    running it themselves.
INSERT INTO maintenance_schedule (scheduler) VALUES ('pg_cron') ON CONFLICT DO NOTHING;

-- What credpool_maintenance does each minute, each step in a transaction of its own
-- (credpool_maintenance_step; each part also callable alone):
--   credpool_reap_expired_leases(1000)   end expired leases in the trail, free their slots
--   credpool_refit_over_limit(100)       refit credentials back under a lowered limit
--   credpool_recover_cooldowns(1000)     record ended cooldowns (credential_events 'cooldown_ended')
--   credpool_purge_audit(retention, 10000)  delete audit rows older than the retention (the
--                                        credential trail, and the lease trail before partitions)
--   credpool_purge_requests('1 hour', 10000)  delete request ids whose lease has ended
--   credpool_compact_pool_versions()     fold the pool versions of exited backends
--   credpool_refit_tenants(100)          refit tenants back under a lowered cap
--   credpool_purge_affinity(NULL, 10000) delete expired affinity bindings, keep them under their cap
--   credpool_make_trail_days(7)          make the lease trail's days a week ahead
--   credpool_audit_advance('continuous', 200000)  advance the continuous proof by a chunk of at
--                                        most 200,000 trail rows per proof, again while it has
--                                        more and the pass is under 30 s (docs/audit.md)
--   credpool_drop_trail_days(retention)  drop the lease trail's days past the retention, whole
--                                        (never one the continuous proof has not proven)
-- Each is safe to run concurrently with itself and with allocation, and idempotent.
--
-- Check the runs:
--   SELECT jobid, status, return_message, start_time FROM cron.job_run_details ORDER BY runid DESC LIMIT 10;
