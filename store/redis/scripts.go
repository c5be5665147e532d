package redis

import goredis "github.com/redis/go-redis/v9"

// The record of a key is one hash, named <prefix>:{<hex of store.Key>}, with
// the fields:
//
//	s  state: p (in progress), c (completed) or r (released)
//	f  fingerprint, 32 bytes (absent once released)
//	t  the last fencing token handed out for the key
//	o  outcome (completed records only)
//	l  lease end, e expiry, c created: server microseconds since the epoch
//
// A released record is kept, without fingerprint or outcome, until the
// expiry its reservation set, only so that its token is remembered: see
// nextToken.
//
// Every script has KEYS: the record, then the marker of its hash slot (see
// loss.go); and ARGV: the clock's offset, the marker's epoch as the store
// read it in New, then its own. Before a script believes a record absent
// (and acquires it, or answers that no record holds the token), it checks
// with lost() that the marker still holds that epoch; otherwise it answers
// the error IDEMKEY_DATALOST with the marker's name, having written nothing:
// the record may have been lost, so its absence means nothing. A record that
// is there needs no check, so that replays and the writes of a held lease
// read no more than they did.
//
// Each script reads the server's clock with TIME and adds ARGV's offset, in
// microseconds: zero but in this package's tests, which move time forward
// without sleeping. Lua numbers are doubles, exact for integers below 2^53:
// microseconds since 1970 stay below that until the year 2255, and Go clamps
// leases and retentions to maxDuration so that sums stay below it too. %.0f
// writes such a number whole (tostring would write 1.7e+15).
const prelude = `
if redis.replicate_commands then redis.replicate_commands() end
-- lost: the error reply to return if the marker does not hold the epoch.
local function lost()
	local mark = redis.call('GET', KEYS[2])
	if mark ~= ARGV[2] then
		return redis.error_reply('IDEMKEY_DATALOST ' .. KEYS[2] .. (mark and ' changed' or ' missing'))
	end
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2]) + tonumber(ARGV[1])
local function num(x) return string.format('%.0f', x) end
-- expireAt sets the key's native expiry at the logical time t, on the real
-- clock, in whole milliseconds rounded up: the record never goes early.
local function expireAt(t)
	redis.call('PEXPIREAT', KEYS[1], math.floor((t - tonumber(ARGV[1])) / 1000) + 1)
end
-- held: the in-progress record of r (s, t, l, e) is held by token tok and
-- has not expired.
local function held(r, tok)
	return r[1] == 'p' and r[2] == tok and (tonumber(r[3]) > now or tonumber(r[4]) > now)
end
`

// reserveScript decides a reservation, as store.Store's Reserve describes.
// ARGV: offset, epoch, fingerprint, lease, retention (microseconds).
// Reply: {kind, token, fingerprint, outcome, lease left, expiry}: kind 1
// acquired, with its token; 2 completed, with the record's fingerprint and
// outcome; 3 in progress, with its fingerprint and the lease's time left;
// each with the record's expiry (e).
//
// A new token is the server's time in microseconds, or one more than the
// key's last token if that is larger. While the record (or its released
// remains) lives, tokens increase; once it has expired, the clock has passed
// every token it held, since each was at most its time of issue plus the few
// handed out in the same microsecond. So a token never repeats for a key
// unless the server's clock steps back by more than a record's whole life.
var reserveScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 'f', 't', 'o', 'l', 'e')
local state, last, leaseEnd, expires = r[1], tonumber(r[3]), tonumber(r[5]), tonumber(r[6])
local absent = not state or state == 'r' or (expires <= now and (state == 'c' or leaseEnd <= now))
if absent then
	local gone = lost()
	if gone then return gone end
else
	if state == 'c' then return {2, 0, r[2], r[4], 0, expires} end
	if leaseEnd > now or r[2] ~= ARGV[3] then return {3, 0, r[2], '', math.max(leaseEnd - now, 0), expires} end
end
local token = now
if last and last >= token then token = last + 1 end
leaseEnd = now + tonumber(ARGV[4])
if absent then
	expires = now + tonumber(ARGV[5])
	redis.call('HSET', KEYS[1], 'c', num(now), 'e', num(expires))
end
redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[3], 't', num(token), 'l', num(leaseEnd))
redis.call('HDEL', KEYS[1], 'o')
expireAt(math.max(expires, leaseEnd))
return {1, token, '', '', 0, expires}
`)

// completeScript records an outcome. ARGV: offset, epoch, token, outcome.
// Reply: 1 recorded, 0 lease lost. A repeat of a Complete that took effect
// (same token and outcome) answers 1 again: go-redis sends a command again
// after a connection error, and a Complete whose replicas did not confirm in
// time is tried again by the interceptor.
var completeScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'e')
if held(r, ARGV[3]) then
	redis.call('HSET', KEYS[1], 's', 'c', 'o', ARGV[4])
	expireAt(tonumber(r[4]))
	return 1
end
if r[1] == 'c' and r[2] == ARGV[3] and tonumber(r[4]) > now and redis.call('HGET', KEYS[1], 'o') == ARGV[4] then
	return 1
end
return lost() or 0
`)

// releaseScript releases a reservation, keeping the token: see reserveScript.
// ARGV: offset, epoch, token. Reply: 1 released, 0 lease lost.
var releaseScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'e')
if held(r, ARGV[3]) then
	redis.call('HSET', KEYS[1], 's', 'r')
	redis.call('HDEL', KEYS[1], 'f', 'o')
	return 1
end
return lost() or 0
`)

// findScript reads a completed record that has not expired. ARGV: offset,
// epoch. Reply: {fingerprint, outcome, expiry}, or nil.
var findScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 'f', 'o', 'e')
if r[1] == 'c' and tonumber(r[4]) > now then return {r[2], r[3], tonumber(r[4])} end
return lost() or false
`)
