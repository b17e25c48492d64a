-- Helpers every guidance script starts with (guidance_scripts.source prepends this file).
-- Conventions: KEYS are P:index, P:bytes, P:total, P:seq, P:deadline; ARGV[1] is the prefix
-- P, ARGV[2] the tombstones' TTL in seconds, ARGV[3] the store's TTL as text for messages
-- (" of 60 s", or "" without a TTL), ARGV[4] the store's clock in epoch seconds ("": the
-- server's); a script's own arguments start at ARGV[5]. Every script returns done(reply):
-- {the versions reconcile found gone, as version, cause, ...; reply}.
local P = ARGV[1]
local INDEX, BYTES, TOTAL, SEQ, DEADLINE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local LOST, MAX_LOST = P .. ':lost', 10000  -- versions found lost, when (outlives tombstones)
local function vkey(v) return P .. ':v:' .. v end
local function rkey(v, r) return P .. ':v:' .. v .. ':r:' .. r end
local function ckey(v, r, g, i) return P .. ':v:' .. v .. ':c:' .. r .. ':' .. g .. ':' .. i end
local function lkey(v, c) return P .. ':v:' .. v .. ':lease:' .. c end
local function tkey(v) return P .. ':tomb:' .. v end
local function now_s()
  if ARGV[4] ~= '' then return tonumber(ARGV[4]) end
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
  redis.call('HDEL', DEADLINE, v)
  redis.call('ZREM', INDEX, v)
  redis.call('DECRBY', TOTAL, b)
  return b
end

-- cause: evicted, deleted, expired, lost or unknown; deadline_ms: when its TTL ran out (0: none)
local function tombstone(v, at, reason, users, b, ttl, cause, deadline_ms)
  redis.call('SET', tkey(v), cjson.encode({at = at, reason = reason, in_use_by = users,
                                           bytes = b, cause = cause,
                                           deadline_ms = deadline_ms}), 'EX', ttl)
end

local GONE = {}
local function done(reply) return {GONE, reply} end

-- Versions whose keys Redis removed leave the accounting, with a tombstone saying why: at or
-- after the deadline their TTL set they expired; before it, or with no TTL, they were lost
-- (evicted by a maxmemory-policy other than noeviction, or deleted outside the store); with
-- no deadline recorded (stores of earlier releases) the two cannot be told apart.
local function reconcile(now)
  local gone = 0
  for _, v in ipairs(redis.call('ZRANGE', INDEX, 0, -1)) do
    if redis.call('EXISTS', vkey(v)) == 0 then
      local d = redis.call('HGET', DEADLINE, v)
      local b = drop_version(v)
      local cause, why = 'unknown', 'gone: Redis removed its keys, and no deadline was ' ..
        'recorded for it, so expiry cannot be told from eviction'
      if d then
        d = tonumber(d)
        if d > 0 and now * 1000 >= d then
          cause, why = 'expired', 'expired: its TTL' .. ARGV[3] .. ' since the first put ran out'
        else
          cause = 'lost'
          why = 'lost: Redis removed its keys ' .. (d > 0 and 'before the deadline its TTL' ..
                ARGV[3] .. ' set' or 'although they had no TTL') .. ': evicted by a ' ..
                'maxmemory-policy other than noeviction, or deleted outside the guidance store'
        end
      end
      if redis.call('EXISTS', tkey(v)) == 0 then
        tombstone(v, now, why, {}, b, tonumber(ARGV[2]), cause, d or 0)
      end
      if cause ~= 'expired' then
        redis.call('ZADD', LOST, now, v)
        redis.call('ZREMRANGEBYRANK', LOST, 0, -MAX_LOST - 1)
      end
      GONE[#GONE + 1] = v
      GONE[#GONE + 1] = cause
      gone = gone + 1
    end
  end
  return gone
end
