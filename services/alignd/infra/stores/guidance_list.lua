-- list: the stored versions, oldest first put first, after reconciling.
-- Reply: {total, then five per version: id, bytes, rollouts, created (epoch s), lessees}.
reconcile(now_s())
local out = {tonumber(redis.call('GET', TOTAL) or '0')}
for _, v in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
  out[#out + 1] = v
  out[#out + 1] = vbytes(v)
  out[#out + 1] = redis.call('SCARD', vkey(v) .. ':rollouts')
  out[#out + 1] = redis.call('HGET', vkey(v), 'created') or '0'
  out[#out + 1] = table.concat(lessees(v), ',')
end
return done(out)
