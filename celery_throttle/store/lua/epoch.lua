-- Makes the store's epoch if it has none, noting when (the store's clock, µs), and the
-- server's replication id then; makes a new one when the server's replication id is no
-- longer the one noted: one call. A server has a new replication id when a replica was
-- promoted in its place (a Sentinel failover), or it restarted: what it holds may then
-- lack writes its predecessor acknowledged and never replicated (or never wrote to
-- disk), so the tasks of the epoch before that the store does not know are sent on from
-- the journal, as after a restart empty. (A restart that lost nothing costs a look: the
-- store knows every task that waits.) So does a server that evicted keys since (its
-- count of evicted keys grew): a line's entries may be gone with them, and only a new
-- epoch lets the keeper tell such a task from one that left its line without a word
-- (an eviction of someone else's keys in a shared server costs a look too). A server
-- that refuses INFO to the store's user (an ACL without it) notes neither, and only a
-- store emptied gets a new epoch.
--
-- KEYS[1]  the journal's state hash
-- ARGV[1]  a new epoch, taken if the store needs one
-- Returns {epoch, since}.
local function info(section, field)
  local ok, text = pcall(redis.call, 'INFO', section)
  return ok and type(text) == 'string' and string.match(text, field .. ':(%w+)') or ''
end
local replid, evicted = info('replication', 'master_replid'), tonumber(info('stats', 'evicted_keys'))
local seen = redis.call('HMGET', KEYS[1], 'epoch', 'replid', 'evicted')
local was = tonumber(seen[3])
if not seen[1] or (seen[2] and replid ~= '' and seen[2] ~= replid) or (was and evicted and evicted > was) then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'since', string.format('%d', t[1] * 1000000 + t[2]))
end
if replid ~= '' and seen[2] ~= replid then redis.call('HSET', KEYS[1], 'replid', replid) end
if evicted and evicted ~= was then redis.call('HSET', KEYS[1], 'evicted', evicted) end
return redis.call('HMGET', KEYS[1], 'epoch', 'since')
