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
//	w  present while a duplicate may wait for the record (a Reserve found it
//	   in progress), so that Complete or Release publish (see watch.go)
//
// A released record is kept, without fingerprint or outcome, until the
// expiry its reservation set, only so that its token is remembered: see
// reserveScript.
//
// Every script has KEYS: the record, then the marker and the write counter
// of its hash slot (see loss.go); and ARGV: the clock's offset, the marker's
// epoch as the store read it in New, the highest value of the counter the
// store has seen, then its own. Before a script believes a record absent
// (and acquires it, or answers that no record holds the token), it checks
// with lost() that the marker still holds that epoch and that the counter
// is not below that value; before it writes a record, that the counter is
// not below it (behind). Both also refuse a marker or counter that has an
// expiry, which none of them is ever given: once it expired, the stores
// could no longer tell. Otherwise it answers the error IDEMKEY_DATALOST
// with the marker's or counter's name, having written nothing: not even the
// counter, which a detecting script would otherwise raise towards what
// another process saw, hiding the loss from it. A record that is there and
// is not written needs no check, so that replays read no more than they did.
// A script that writes a reservation, an outcome, a step or a lease's
// renewal raises the counter (INCR) and returns its new value; Release and
// ForgetSteps do not (see Store.Release).
//
// Each script reads the server's clock with TIME and adds ARGV's offset, in
// microseconds: zero but in this package's tests, which move time forward
// without sleeping. Lua numbers are doubles, exact for integers below 2^53:
// microseconds since 1970 stay below that until the year 2255, and Go clamps
// leases and retentions to maxDuration so that sums stay below it too; a
// counter raised a million times a second, for 285 years. %.0f writes such a
// number whole (tostring would write 1.7e+15).
const prelude = `
if redis.replicate_commands then redis.replicate_commands() end
local function num(x) return string.format('%.0f', x) end
-- behind: the error reply to return if the write counter is below the
-- highest value the store saw (the server went back to an older state), is
-- gone though the store saw it, or will expire (someone set a TTL on it).
local function behind()
	local n = redis.call('GET', KEYS[3])
	if not n then
		if tonumber(ARGV[3]) > 0 then
			return redis.error_reply('IDEMKEY_DATALOST ' .. KEYS[3] .. ' gone ' .. ARGV[3])
		end
		return
	end
	if redis.call('PTTL', KEYS[3]) >= 0 then
		return redis.error_reply('IDEMKEY_DATALOST ' .. KEYS[3] .. ' expiring')
	end
	n = tonumber(n)
	if n < tonumber(ARGV[3]) then
		return redis.error_reply('IDEMKEY_DATALOST ' .. KEYS[3] .. ' behind ' .. num(n) .. ' ' .. ARGV[3])
	end
end
-- lost: the error reply to return if the marker does not hold the epoch or
-- will expire, or the write counter is behind.
local function lost()
	local mark = redis.call('GET', KEYS[2])
	if mark ~= ARGV[2] then
		return redis.error_reply('IDEMKEY_DATALOST ' .. KEYS[2] .. (mark and ' changed' or ' missing'))
	end
	if redis.call('PTTL', KEYS[2]) >= 0 then
		return redis.error_reply('IDEMKEY_DATALOST ' .. KEYS[2] .. ' expiring')
	end
	return behind()
end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2]) + tonumber(ARGV[1])
-- real: the logical time t on the real clock, in whole milliseconds rounded
-- up, for a native expiry that never comes early.
local function real(t) return math.floor((t - tonumber(ARGV[1])) / 1000) + 1 end
-- expireAt sets the record's native expiry at the logical time t.
local function expireAt(t)
	redis.call('PEXPIREAT', KEYS[1], real(t))
end
-- changed: tells the stores' subscribers (Watch) that the record changed,
-- on <prefix>:changed, with the record's name <prefix>:{<hex>}, if w, the
-- record's field w, says a duplicate waits for it.
local function changed(w)
	if w then
		-- pcall: a server that refuses the channel (an ACL user without
		-- it) costs the waiters their wake-up, never the write.
		redis.pcall('PUBLISH', string.sub(KEYS[1], 1, -68) .. ':changed', KEYS[1])
		redis.call('HDEL', KEYS[1], 'w')
	end
end
-- held: the in-progress record of r (s, t, l, e) is held by token tok and
-- has not expired.
local function held(r, tok)
	return r[1] == 'p' and r[2] == tok and (tonumber(r[3]) > now or tonumber(r[4]) > now)
end
`

// reserveScript decides a reservation, as store.Store's Reserve describes.
// ARGV: offset, epoch, count seen, fingerprint, lease, retention
// (microseconds). Reply: {kind, token, fingerprint, outcome, lease left,
// expiry, count}: kind 1 acquired, with its token and the write counter's
// new value; 2 completed, with the record's fingerprint and outcome; 3 in
// progress, with its fingerprint and the lease's time left; each with the
// record's expiry (e), and a count of 0 when it wrote nothing.
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
local gone
if absent then
	gone = lost()
else
	if state == 'c' then return {2, 0, r[2], r[4], 0, expires, 0} end
	if leaseEnd > now or r[2] ~= ARGV[4] then
		-- A duplicate may wait: its Complete or Release will tell (changed).
		-- A server out of memory refuses the field, and Watch then waits for
		-- the duplicate's next poll.
		redis.pcall('HSET', KEYS[1], 'w', '1')
		return {3, 0, r[2], '', math.max(leaseEnd - now, 0), expires, 0}
	end
	gone = behind() -- a lease taken over
end
if gone then return gone end
local token = now
if last and last >= token then token = last + 1 end
leaseEnd = now + tonumber(ARGV[5])
if absent then
	expires = now + tonumber(ARGV[6])
	redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[4], 't', num(token), 'l', num(leaseEnd), 'c', num(now), 'e', num(expires))
else
	redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[4], 't', num(token), 'l', num(leaseEnd))
end
if r[4] then redis.call('HDEL', KEYS[1], 'o') end -- an expired record's
expireAt(math.max(expires, leaseEnd))
return {1, token, '', '', 0, expires, redis.call('INCR', KEYS[3])}
`)

// completeScript records an outcome. ARGV: offset, epoch, count seen,
// token, outcome. Reply: {1, the write counter's new value} recorded, {0, 0}
// lease lost. A repeat of a Complete that took effect (same token and
// outcome) answers recorded again: go-redis sends a command again after a
// connection error, and a Complete whose replicas did not confirm in time is
// tried again by the engine. The repeat raises the counter too, so that
// the WAIT after it (on this connection) covers the first's write.
var completeScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'e', 'w')
local holds = held(r, ARGV[4])
if not holds and not (r[1] == 'c' and r[2] == ARGV[4] and tonumber(r[4]) > now and redis.call('HGET', KEYS[1], 'o') == ARGV[5]) then
	return lost() or {0, 0}
end
local gone = behind()
if gone then return gone end
if holds then
	redis.call('HSET', KEYS[1], 's', 'c', 'o', ARGV[5])
	expireAt(tonumber(r[4]))
	changed(r[5])
end
return {1, redis.call('INCR', KEYS[3])}
`)

// releaseScript releases a reservation, keeping the token: see reserveScript.
// ARGV: offset, epoch, count seen, token. Reply: {1, 0} released, {0, 0}
// lease lost.
var releaseScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'e', 'w')
if held(r, ARGV[4]) then
	local gone = behind()
	if gone then return gone end
	redis.call('HSET', KEYS[1], 's', 'r')
	redis.call('HDEL', KEYS[1], 'f', 'o')
	changed(r[5])
	return {1, 0}
end
return lost() or {0, 0}
`)

// findScript reads a completed record that has not expired. ARGV: offset,
// epoch, count seen. Reply: {fingerprint, outcome, expiry}, or nil.
var findScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 'f', 'o', 'e')
if r[1] == 'c' and tonumber(r[4]) > now then return {r[2], r[3], tonumber(r[4])} end
return lost() or false
`)

// The steps of a key (store.Stepper) are one hash beside its record, named
// <prefix>:{<hex of store.Key>}:steps, in the record's hash slot: a field
// per step, named as it is, holding
//
//	<expiry> <fingerprint, 32 bytes><s (started) or d (done)><result>
//
// with the expiry in server microseconds, as the record's: its record's
// expiry (e, or its lease's end if later) when the step was started, so
// that a step outlives Release and the lease, and a step past it counts as
// absent. The hash expires natively with its last step. The step scripts
// have the record's KEYS and ARGV (offset, epoch, count seen), the hash as
// KEYS[4], then ARGV: the token, then their own. Each writes only for the
// run whose token holds the record in progress, checking for a loss as the
// record's scripts do: lost() before it starts a step it found absent or
// answers that none is there, behind() before other writes. Starting and
// finishing a step raise the write counter, so that a step lost to a
// server gone back to an older state is not taken for one never started.
// PEXPIRETIME needs Redis 7.
const stepPrelude = `
-- r: the record's s, t, l, e, for held(). step: the unexpired record of
-- step name, as {expiry, fingerprint, s or d, result}, or nil.
local function step(name)
	local v = redis.call('HGET', KEYS[4], name)
	if not v then return nil end
	local i = string.find(v, ' ', 1, true)
	local expires = tonumber(string.sub(v, 1, i - 1))
	if expires <= now then return nil end
	return {expires, string.sub(v, i + 1, i + 32), string.sub(v, i + 33, i + 33), string.sub(v, i + 34)}
end
local r = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'e')
`

// startStepScript starts a step: store.Stepper's StartStep. ARGV: offset,
// epoch, count seen, token, name, fingerprint. Reply: {kind, count,
// fingerprint, result}: kind 1 started now, with the write counter's new
// value; 2 started before, 3 done, each with the step's fingerprint and
// result and a count of 0; {0, 0} lease lost.
var startStepScript = goredis.NewScript(prelude + stepPrelude + `
if not held(r, ARGV[4]) then return lost() or {0, 0} end
local found = step(ARGV[5])
if found then return {found[3] == 'd' and 3 or 2, 0, found[2], found[4]} end
local gone = lost()
if gone then return gone end
local expires = math.max(tonumber(r[4]), tonumber(r[3]))
redis.call('HSET', KEYS[4], ARGV[5], num(expires) .. ' ' .. ARGV[6] .. 's')
if redis.call('PEXPIRETIME', KEYS[4]) < real(expires) then
	redis.call('PEXPIREAT', KEYS[4], real(expires))
end
return {1, redis.call('INCR', KEYS[3]), '', ''}
`)

// finishStepScript records a step's result. ARGV: offset, epoch, count
// seen, token, name, result. Reply: {1, the write counter's new value}
// recorded, {0, 0} lease lost or no such step. A repeat records the same
// again.
var finishStepScript = goredis.NewScript(prelude + stepPrelude + `
local found = held(r, ARGV[4]) and step(ARGV[5])
if not found then return lost() or {0, 0} end
local gone = behind()
if gone then return gone end
redis.call('HSET', KEYS[4], ARGV[5], num(found[1]) .. ' ' .. found[2] .. 'd' .. ARGV[6])
return {1, redis.call('INCR', KEYS[3])}
`)

// forgetStepsScript deletes the steps named, or all. ARGV: offset, epoch,
// count seen, token, names. Reply: {1, 0} deleted, {0, 0} lease lost. Like
// Release, it raises no counter: a deletion lost to a failover brings a
// step back, which runs nothing twice.
var forgetStepsScript = goredis.NewScript(prelude + stepPrelude + `
if not held(r, ARGV[4]) then return lost() or {0, 0} end
local gone = behind()
if gone then return gone end
if #ARGV > 4 then
	redis.call('HDEL', KEYS[4], unpack(ARGV, 5))
else
	redis.call('DEL', KEYS[4])
end
return {1, 0}
`)

// renewScript ends the lease of the record token holds in progress lease
// from now: store.Renewer. ARGV: offset, epoch, count seen, token, lease
// (microseconds). Reply: {1, the write counter's new value} renewed, {0, 0}
// lease lost. It raises the counter, so that with WithReplicas a renewal is
// confirmed: one lost to a failover would let another run take over a live
// one.
var renewScript = goredis.NewScript(prelude + `
local r = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'e')
if not held(r, ARGV[4]) then return lost() or {0, 0} end
local gone = behind()
if gone then return gone end
local leaseEnd = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'l', num(leaseEnd))
expireAt(math.max(tonumber(r[4]), leaseEnd))
return {1, redis.call('INCR', KEYS[3])}
`)
