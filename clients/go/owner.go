package ticketd

import (
	"crypto/rand"
	"encoding/binary"
	"sync/atomic"
	"time"
)

// Owners (PROTOCOL §3): mix(base + n), base 64 random bits drawn once per
// process, n a process-wide counter. mix (the splitmix64 finaliser) is a
// bijection, so no two calls of a process share an owner, and owners are
// unlikely to collide with another process's.
var (
	ownerBase    = randomBase()
	ownerCounter atomic.Uint64
)

func randomBase() uint64 {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return uint64(time.Now().UnixNano())
	}
	return binary.LittleEndian.Uint64(b[:])
}

func mix(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

func nextOwner() uint64 {
	return mix(ownerBase + ownerCounter.Add(1) - 1)
}
