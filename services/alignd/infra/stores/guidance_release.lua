-- release: drop a consumer's lease. ARGV[5..6]: version, consumer.
-- Reply: 1 if the lease was held, else 0.
local v, c = ARGV[5], ARGV[6]
redis.call('SREM', vkey(v) .. ':lessees', c)
return done(redis.call('DEL', lkey(v, c)))
