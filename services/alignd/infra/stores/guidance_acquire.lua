-- acquire: a consumer's lease on a version, a key that expires by itself.
-- ARGV[5..7]: version, consumer, ttl_ms. Reply: 1.
local v, c, ttl = ARGV[5], ARGV[6], tonumber(ARGV[7])
redis.call('SET', lkey(v, c), string.format('%.6f', now_s()), 'PX', ttl)
local set = vkey(v) .. ':lessees'
redis.call('SADD', set, c)
if redis.call('PTTL', set) < ttl then redis.call('PEXPIRE', set, ttl) end  -- -1: new set
return done(1)
