-- commit: the last command of a put's MULTI/EXEC, after the SETs of the new chunks.
-- ARGV[5..10]: version, generation, budget bytes (-1: none), on_in_use ('evict' | 'refuse'),
-- ttl_ms (0: none), chunk size; then four per rollout: id, length, chunks, crc32.
-- Reconciles expired versions, checks the budget, evicts whole versions (oldest first put
-- first, unleased before leased), deletes the replaced generations' chunks, writes the
-- metas and updates the accounting.
-- Reply: {'ok', total, evicted version, its bytes, its lessees (comma-joined), ...}
--     or {'too_large', bytes the version would hold, total}     (nothing written)
--     or {'in_use', bytes still missing, total, leased version, its lessees, ...}
-- A refusal removes the new chunks again, so that the transaction leaves nothing behind.
local v, gen, budget, on_in_use = ARGV[5], ARGV[6], tonumber(ARGV[7]), ARGV[8]
local ttl_ms, cs = tonumber(ARGV[9]), ARGV[10]
local now = now_s()
reconcile(now)
local recs, delta = {}, 0
for k = 11, #ARGV, 4 do
  local r, len, n = ARGV[k], tonumber(ARGV[k + 1]), tonumber(ARGV[k + 2])
  local old = redis.call('HMGET', rkey(v, r), 'len', 'n', 'gen')
  delta = delta + len - tonumber(old[1] or '0')
  recs[#recs + 1] = {r, len, n, ARGV[k + 3], old[2], old[3]}
end
local function unlink_new()
  for _, x in ipairs(recs) do
    for i = 0, x[3] - 1 do redis.call('UNLINK', ckey(v, x[1], gen, i)) end
  end
end
local total = tonumber(redis.call('GET', TOTAL) or '0')
local mine = vbytes(v)
local evict = {}
if budget >= 0 and total + delta > budget then
  if mine + delta > budget then
    unlink_new()
    return done({'too_large', mine + delta, total})
  end
  local need = total + delta - budget
  local leased = {}
  for _, c in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
    if c ~= v then
      local who = lessees(c)
      if #who > 0 then leased[#leased + 1] = {c, who}
      elseif need > 0 then
        evict[#evict + 1] = {c, who}
        need = need - vbytes(c)
      end
    end
  end
  if need > 0 then
    if on_in_use ~= 'evict' then
      unlink_new()
      local out = {'in_use', need, total}
      for _, e in ipairs(leased) do
        out[#out + 1] = e[1]
        out[#out + 1] = table.concat(e[2], ',')
      end
      return done(out)
    end
    for _, e in ipairs(leased) do
      if need > 0 then
        evict[#evict + 1] = e
        need = need - vbytes(e[1])
      end
    end
  end
end
local reply = {'ok', 0}
for _, e in ipairs(evict) do
  local c, who = e[1], e[2]
  local b = drop_version(c)
  local why = 'evicted to keep the guidance store within its budget of ' .. ARGV[7] ..
              ' bytes, making room for version ' .. v
  if #who > 0 then
    why = 'evicted while in use by ' .. table.concat(who, ', ') .. " (on_in_use='evict'): " ..
          'the budget of ' .. ARGV[7] .. ' bytes had no room for version ' .. v ..
          ' otherwise'
  end
  tombstone(c, now, why, who, b, tonumber(ARGV[2]), 'evicted')
  reply[#reply + 1] = c
  reply[#reply + 1] = b
  reply[#reply + 1] = table.concat(who, ',')
end
local vk = vkey(v)
local deadline = 0
if redis.call('EXISTS', vk) == 0 then
  local seq = redis.call('INCR', SEQ)
  if ttl_ms > 0 then deadline = math.floor(now * 1000) + ttl_ms end
  redis.call('HSET', vk, 'created', string.format('%.6f', now), 'seq', seq,
             'deadline_ms', string.format('%d', deadline))
  redis.call('ZADD', INDEX, seq, v)
  redis.call('HSET', DEADLINE, v, string.format('%d', deadline))
  redis.call('DEL', tkey(v))
  redis.call('ZREM', LOST, v)
else
  deadline = tonumber(redis.call('HGET', vk, 'deadline_ms') or '0')
  redis.call('HSETNX', DEADLINE, v, string.format('%d', deadline))
end
local created = string.format('%.6f', now)
local rs = vk .. ':rollouts'
for _, x in ipairs(recs) do
  local r, n, old_n, old_gen = x[1], x[3], x[5], x[6]
  if old_gen and old_gen ~= gen then
    for i = 0, tonumber(old_n) - 1 do redis.call('UNLINK', ckey(v, r, old_gen, i)) end
  end
  local rk = rkey(v, r)
  redis.call('HSET', rk, 'len', x[2], 'n', n, 'cs', cs, 'gen', gen, 'crc', x[4],
             'created', created)
  redis.call('SADD', rs, r)
  if deadline > 0 then
    redis.call('PEXPIREAT', rk, deadline)
    for i = 0, n - 1 do redis.call('PEXPIREAT', ckey(v, r, gen, i), deadline) end
  end
end
if deadline > 0 then
  redis.call('PEXPIREAT', vk, deadline)
  redis.call('PEXPIREAT', rs, deadline)
end
redis.call('HINCRBY', BYTES, v, delta)
reply[2] = redis.call('INCRBY', TOTAL, delta)
return done(reply)
