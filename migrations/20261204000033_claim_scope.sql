-- A claim checks its tenant's pools again (the service checked them when the request arrived):
-- a claim of a pool its tenant's scope no longer admits grants nothing and says so.
ALTER TYPE credpool_claim_state ADD VALUE IF NOT EXISTS 'pool_not_allowed';
