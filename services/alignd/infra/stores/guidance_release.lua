-- release: drop a consumer's lease. ARGV[4..5]: version, consumer.
-- Reply: 1 if the lease was held, else 0.
local v, c = ARGV[4], ARGV[5]
redis.call('SREM', vkey(v) .. ':lessees', c)
return redis.call('DEL', lkey(v, c))
