"""Every Lua script of pagefleet, in one place: what each touches (KEYS), takes (ARGV) and returns.

The protocol these scripts are part of (every key, every stream's entries) is written in
docs/REDIS.md; the key names are ``pagefleet.common.redis.Keys``. Every script touches the keys
of one shard only (all under its hash tag ``{<shard>}``), so each runs on one Redis Cluster slot.
Users: the gateway (``ADMIT_AND_QUEUE``), the scheduler (``ASSIGN``, ``FINISH`` for its own final
messages, ``TAKE_EPOCH``, ``LEASE_RENEW``, ``LEASE_RELEASE``) and the workers (``FINISH``, ``MOVE_OWNER``), through
``pagefleet.common.fencing`` where they fence.
"""

# -- the gateway -----------------------------------------------------------------------------------
# A request is admitted and queued in one atomic step (``ADMIT_AND_QUEUE``):
# * the bound is exact: the requests stream's length (entries leave when their requests
#   finish) and the scheduler's published queue length are read where the entry is added, so
#   gateways racing each other (or one gateway's concurrent calls) never admit past it;
# * every id is claimed with its entry (a gateway-chosen one with an empty fingerprint, which no
#   client's request matches), by one ``SET NX`` once the bound is met:
#   taken already, the request was queued before (a retry after a lost reply answers 0, and is
#   relayed even when the queue is full now: a full queue looks the claim up). The claim's value
#   is the request's fingerprint (``GatewayCore.fingerprint``: its prompt and sampling), so a
#   call with the same id and another request is told so (-2) instead of relayed another's
#   output; a retry appends a '+' (up to 8), so a first caller that hangs up while a retry
#   relays the request does not cancel it (``GatewayCore.leave``). A claim never stays without
#   its entry (every retry would wait for output that never comes): a failing XADD deletes it
#   again, in the same atomic step. Nothing is written before the bound's reads.
# KEYS: requests stream, published queue length[, idempotency key: every id's now; without it (a
# gateway from before), nothing is claimed]. ARGV: max stream length,
# max queue, the claim's TTL, the request's fingerprint ('' matches any), then the entry's
# field/value pairs.
# {1, entry id}: queued now; {0}: before; {-1, waiting, length}: full, nothing written;
# {-2}: the id is another request's, nothing written.
ADMIT_AND_QUEUE = """
local claim = #KEYS == 3
local function queued_before()
  local held = redis.call('GET', KEYS[3])
  if not held then return nil end
  if string.match(held, '^%d+$') then  -- a claim of a gateway from before fingerprints: a count
    redis.call('INCR', KEYS[3])
    return {0}
  end
  if string.sub(held, 1, #ARGV[4]) ~= ARGV[4] then return {-2} end
  if #held < #ARGV[4] + 8 then redis.call('APPEND', KEYS[3], '+') end
  return {0}
end
local length = redis.call('XLEN', KEYS[1])
local waiting = tonumber(redis.call('GET', KEYS[2]) or length)
if length >= tonumber(ARGV[1]) or waiting >= tonumber(ARGV[2]) then
  local before = claim and queued_before()
  if before then return before end
  return {-1, waiting, length}
end
if claim and not redis.call('SET', KEYS[3], ARGV[4], 'NX', 'EX', tonumber(ARGV[3])) then
  local before = queued_before()
  if before then return before end
  return {-2}  -- gone between the SET and the GET (it cannot: one script runs at a time)
end
local fields = {}
for i = 5, #ARGV do fields[i - 4] = ARGV[i] end
local id = redis.pcall('XADD', KEYS[1], '*', unpack(fields))
if type(id) == 'table' and id.err then
  if claim then redis.call('DEL', KEYS[3]) end
  return id
end
return {1, id}
"""


# -- ownership and output (pagefleet.common.fencing) --------------------------------------------------
# Epochs that fence (a request's, the scheduler's) never go backwards, even when a Redis
# Cluster failover loses the primary's last acknowledged writes (replication is asynchronous):
# a new epoch is the larger of the last one + 1 and Redis's clock in microseconds, so an epoch
# handed out before the loss (at most the old primary's clock then) is below any handed out
# after it (the new primary's clock, later). Needs clocks in step to better than a failover
# takes (seconds); costs no WAIT on the hot path.
# One script for a whole round of assignments: the scheduler's epoch is checked and Redis's
# clock read once, then each request costs its owner record's HMGET, HSET and EXPIRE.
# KEYS: scheduler epoch key, then each request's own. ARGV: scheduler epoch, ttl, then for each
# request: worker id ('': a new epoch only, the last worker, its steps stream and the time kept
# for ``take_over``), the worker's steps stream.
# Returns the new epoch of each request (0: it is done already); every entry -1 if this
# scheduler is stale (nothing written). An epoch is written with '%.0f': Lua turns a number
# into a string with 14 digits, and one in microseconds has 16 (exact below 2^53).
ASSIGN = """
local n = #KEYS - 1
local out = {}
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[1] then
  for i = 1, n do out[i] = -1 end
  return out
end
local now = redis.call('TIME')
local now_us = now[1] * 1000000 + now[2]
local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
local ttl = tonumber(ARGV[2])
for i = 1, n do
  local own, worker = KEYS[i + 1], ARGV[1 + 2 * i]
  local cur = redis.call('HMGET', own, 'epoch', 'done')
  if cur[2] == '1' then
    out[i] = 0
  else
    local epoch = math.max(tonumber(cur[1] or '0') + 1, now_us)
    if worker ~= '' then
      redis.call('HSET', own, 'epoch', string.format('%.0f', epoch), 'worker', worker, 't', now_ms,
                 'steps', ARGV[2 + 2 * i])
    else
      redis.call('HSET', own, 'epoch', string.format('%.0f', epoch))
    end
    redis.call('EXPIRE', own, ttl)
    out[i] = epoch
  end
end
return out
"""

# A request's ownership moves between workers with its KV (a migration's handover,
# ``pagefleet.common.handover``): only while the owner record still names ``from`` under
# ``epoch`` (not done), it takes a new epoch (as ``ASSIGN``'s: never backwards) and names
# ``to``, its steps stream and the time the new owner's messages are read back from; in the
# same atomic step what ``from`` wrote for the request (a StepOutputs piece) is appended to the
# request's own record (the owner record's ``out``), so every token before the new owner's first
# is in Redis whatever became of ``from``'s writes. ``from`` equal to ``to``: the source takes the
# request back (a handover whose answer was lost), which the target's late handover then cannot pass.
# A move is named (``mv``: its name and the epoch it took, kept in the record): sent again after
# its reply was lost, one that landed answers that epoch again, changing nothing (it was refused
# as "no longer from's"), while the record still holds it (not after a fence or another move).
# KEYS: own. ARGV: epoch, from, to, to's steps stream, ttl, record ('' for none), the move's name.
# Returns the new epoch; 0 if the record no longer names ``from`` under ``epoch`` (or it is done).
MOVE_OWNER = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'worker', 'done', 'out', 'mv')
if cur[5] == ARGV[7] .. ':' .. (cur[1] or '') and cur[2] == ARGV[3] and cur[3] ~= '1' then return tonumber(cur[1]) end
if cur[3] == '1' or (cur[1] or '0') ~= ARGV[1] or (cur[2] or '') ~= ARGV[2] then return 0 end
local now = redis.call('TIME')
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', math.max(1, now[1] * 1000000 + now[2] - tonumber(cur[1])))
redis.call('HSET', KEYS[1], 'worker', ARGV[3], 't', now[1] * 1000 + math.floor(now[2] / 1000), 'steps', ARGV[4],
           'out', (cur[4] or '') .. ARGV[6], 'mv', ARGV[7] .. ':' .. string.format('%.0f', epoch))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return epoch
"""

# The epoch of a scheduler that has just taken the lease (as ``ASSIGN``'s: never backwards).
# KEYS: the scheduler epoch key. Returns the new epoch.
TAKE_EPOCH = """
local now = redis.call('TIME')
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
return redis.call('INCRBY', KEYS[1], math.max(1, now[1] * 1000000 + now[2] - last))
"""

# A write that finishes requests: the step's other messages and each final message whose
# writer still owns its request, in one steps entry (a field per gateway process: each
# message in the field of the gateway that relays its request); then, for those, the finish:
# the owner record marked done with the request's record of everything its writer wrote
# (field ``fin``), both lifetimes shortened, the requests' entries acknowledged and deleted
# (one XACK and one XDEL for all), and one done entry naming them all (space-separated: ids
# are A-Z a-z 0-9 . _ : -).
# KEYS: steps stream, requests stream, done stream, then for each final: own, idempotency key.
# ARGV: group, done maxlen, done ttl, steps MINID ('': no trim), steps ttl, m, then m pairs (field, the other
# messages of that field: a StepOutputs), n, then for each final: epoch, entry id ('' for
# none), request id, finish reason, its field, its message (a StepOutputs piece), its record
# (a StepOutputs piece).
# Returns the steps entry's id and, per final, 1 if written, 0 if refused (stale epoch or done).
# A fenced stream: an error.
FINISH = """
local m = tonumber(ARGV[6])
local pieces, order = {}, {}
for j = 1, m do
  local f = ARGV[5 + 2 * j]
  pieces[f] = {ARGV[6 + 2 * j]}
  order[j] = f
end
local base = 7 + 2 * m
local n = tonumber(ARGV[base])
local ok = {}
for i = 1, n do
  local a = base + 1 + 7 * (i - 1)
  local cur = redis.call('HMGET', KEYS[2 * i + 2], 'epoch', 'done')
  ok[i] = ((cur[1] or '0') == ARGV[a] and cur[2] ~= '1') and 1 or 0
  if ok[i] == 1 then
    local f = ARGV[a + 4]
    if pieces[f] == nil then
      pieces[f] = {}
      order[#order + 1] = f
    end
    local p = pieces[f]
    p[#p + 1] = ARGV[a + 5]
  end
end
local xadd = {KEYS[1]}
if ARGV[4] ~= '' then
  xadd = {KEYS[1], 'MINID', '~', ARGV[4]}
end
xadd[#xadd + 1] = '*'
for _, f in ipairs(order) do
  xadd[#xadd + 1] = f
  xadd[#xadd + 1] = table.concat(pieces[f])
end
if #order == 0 then
  xadd[#xadd + 1] = 'o'
  xadd[#xadd + 1] = ''
end
local id = redis.call('XADD', unpack(xadd))
if ARGV[5] ~= '0' then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5])) end
local done_ttl = tonumber(ARGV[3])
local rids, epochs, reasons, entries = {}, {}, {}, {}
for i = 1, n do
  if ok[i] == 1 then
    local a = base + 1 + 7 * (i - 1)
    local own = KEYS[2 * i + 2]
    redis.call('HSET', own, 'done', '1', 'fin', ARGV[a + 6])
    redis.call('EXPIRE', own, done_ttl)
    redis.call('EXPIRE', KEYS[2 * i + 3], done_ttl)  -- the request's claim (a no-op if none: an older gateway's)
    if ARGV[a + 1] ~= '' then entries[#entries + 1] = ARGV[a + 1] end
    rids[#rids + 1] = ARGV[a + 2]
    epochs[#epochs + 1] = ARGV[a]
    reasons[#reasons + 1] = ARGV[a + 3]
  end
end
if #entries > 0 then
  redis.call('XACK', KEYS[2], ARGV[1], unpack(entries))
  redis.call('XDEL', KEYS[2], unpack(entries))
end
if #rids > 0 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'rid', table.concat(rids, ' '),
             'epoch', table.concat(epochs, ' '), 'f', table.concat(reasons, ' '))
end
return {id, ok}
"""


# -- the scheduler's lease ------------------------------------------------------------------------
# KEYS: the lease. ARGV: this scheduler's instance id, the lease's length (ms).
# Renew if still ours; 1 when renewed, 0 when someone else holds it.
LEASE_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"

# KEYS: the lease. ARGV: this scheduler's instance id. Deletes the lease if still ours (1), else 0.
LEASE_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
