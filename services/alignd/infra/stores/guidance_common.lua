-- Helpers every guidance script starts with (guidance_scripts.source prepends this file).
-- Conventions: KEYS are P:index, P:bytes, P:total, P:seq; ARGV[1] is the prefix P,
-- ARGV[2] the tombstones' TTL in seconds, ARGV[3] the store's TTL as text for messages
-- (" of 60 s", or "" without a TTL); a script's own arguments start at ARGV[4].
local P = ARGV[1]
local INDEX, BYTES, TOTAL, SEQ = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local function vkey(v) return P .. ':v:' .. v end
local function rkey(v, r) return P .. ':v:' .. v .. ':r:' .. r end
local function ckey(v, r, g, i) return P .. ':v:' .. v .. ':c:' .. r .. ':' .. g .. ':' .. i end
local function lkey(v, c) return P .. ':v:' .. v .. ':lease:' .. c end
local function tkey(v) return P .. ':tomb:' .. v end
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function vbytes(v) return tonumber(redis.call('HGET', BYTES, v) or '0') end

-- consumers whose lease on v is alive (forgets the ones that ran out)
local function lessees(v)
  local set = vkey(v) .. ':lessees'
  local out = {}
  for _, c in ipairs(redis.call('SMEMBERS', set)) do
    if redis.call('EXISTS', lkey(v, c)) == 1 then out[#out + 1] = c
    else redis.call('SREM', set, c) end
  end
  table.sort(out)
  return out
end

-- delete every key of v and its accounting; returns the bytes it held
local function drop_version(v)
  local rs = vkey(v) .. ':rollouts'
  for _, r in ipairs(redis.call('SMEMBERS', rs)) do
    local m = redis.call('HMGET', rkey(v, r), 'n', 'gen')
    if m[1] then
      for i = 0, tonumber(m[1]) - 1 do redis.call('UNLINK', ckey(v, r, m[2], i)) end
    end
    redis.call('UNLINK', rkey(v, r))
  end
  local ls = vkey(v) .. ':lessees'
  for _, c in ipairs(redis.call('SMEMBERS', ls)) do redis.call('UNLINK', lkey(v, c)) end
  redis.call('UNLINK', rs, ls, vkey(v))
  local b = vbytes(v)
  redis.call('HDEL', BYTES, v)
  redis.call('ZREM', INDEX, v)
  redis.call('DECRBY', TOTAL, b)
  return b
end

local function tombstone(v, at, reason, users, b, ttl)
  redis.call('SET', tkey(v), cjson.encode({at = at, reason = reason, in_use_by = users,
                                           bytes = b}), 'EX', ttl)
end

-- versions whose keys expired leave the accounting; ARGV[2] tombstone ttl, ARGV[3] ttl text
local function reconcile(now)
  local gone = 0
  for _, v in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
    if redis.call('EXISTS', vkey(v)) == 0 then
      local b = drop_version(v)
      if redis.call('EXISTS', tkey(v)) == 0 then
        tombstone(v, now, 'expired: its TTL' .. ARGV[3] .. ' since the first put ran out', {},
                  b, tonumber(ARGV[2]))
      end
      gone = gone + 1
    end
  end
  return gone
end
