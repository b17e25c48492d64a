-- delete: every key of a version, with a tombstone saying so.
-- ARGV[5]: version. Reply: {existed (0 | 1), bytes it held, total}.
local now = now_s()
reconcile(now)
local v = ARGV[5]
if redis.call('EXISTS', vkey(v)) == 0 then
  return done({0, 0, tonumber(redis.call('GET', TOTAL) or '0')})
end
local b = drop_version(v)
tombstone(v, now, 'deleted by request (delete_version)', {}, b, tonumber(ARGV[2]), 'deleted')
return done({1, b, tonumber(redis.call('GET', TOTAL) or '0')})
