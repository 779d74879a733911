package ticketd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"
)

// Wire ops (PROTOCOL §1, §5.1, §6.1).
const (
	opAcquire     = 'A' // request Acquire, reply Acquired
	opRelease     = 'R' // request Release, reply Released
	opExtend      = 'E' // request Extend, reply Extended (protocol 1.1)
	opTimeout     = 'T'
	opBusy        = 'B'
	opNotReleased = 'N'
	opNotExtended = 'X' // protocol 1.1
	// opAcquireWithLimit is the request Acquire With Limit (protocol 1.2).
	opAcquireWithLimit = 'P'
	// opLimitMismatch is the reply LimitMismatch (protocol 1.2).
	opLimitMismatch = 'L'
)

// replyHeader is the fixed header length of each reply op, op byte
// included; the key and its newline follow.
func replyHeader(op byte) int {
	switch op {
	case opAcquire:
		return 17
	case opTimeout, opBusy, opRelease, opNotReleased, opExtend, opNotExtended:
		return 9
	case opLimitMismatch:
		return 11
	}
	return 0
}

func appendAcquire(b []byte, wait, lease uint8, owner uint64, key string) []byte {
	b = append(b, opAcquire, wait, lease)
	b = binary.BigEndian.AppendUint64(b, owner)
	b = append(b, key...)
	return append(b, '\n')
}

// appendAcquireWithLimit encodes 'P' wait:u8 lease:u8 owner:u64 limit:u16
// mode:u8 key '\n' (protocol 1.2).
func appendAcquireWithLimit(b []byte, wait, lease uint8, owner uint64, places Places, key string) []byte {
	b = append(b, opAcquireWithLimit, wait, lease)
	b = binary.BigEndian.AppendUint64(b, owner)
	b = binary.BigEndian.AppendUint16(b, places.Limit)
	b = append(b, byte(places.Mode))
	b = append(b, key...)
	return append(b, '\n')
}

func appendRelease(b []byte, token uint64, key string) []byte {
	b = append(b, opRelease)
	b = binary.BigEndian.AppendUint64(b, token)
	b = append(b, key...)
	return append(b, '\n')
}

func appendExtend(b []byte, lease uint8, token uint64, key string) []byte {
	b = append(b, opExtend, lease)
	b = binary.BigEndian.AppendUint64(b, token)
	b = append(b, key...)
	return append(b, '\n')
}

// reply is one decoded reply. a is the token for A/R/N/E/X and the owner
// for T/B/L; owner is set for A only; limit, the key's limit, for L only.
type reply struct {
	op    byte
	a     uint64
	owner uint64
	key   string
	limit uint16
}

var errNeedMore = errors.New("need more bytes")

// decodeReply decodes the reply at the start of buf: the reply and the
// bytes it used; errNeedMore if buf holds only part of one; another error
// if the stream cannot be a reply stream. It never looks further than the
// header plus maxKeyBytes+1 bytes for the newline, so a stream without one
// is malformed after a bounded amount of input.
func decodeReply(buf []byte, maxKeyBytes int) (reply, int, error) {
	if len(buf) == 0 {
		return reply{}, 0, errNeedMore
	}
	op := buf[0]
	h := replyHeader(op)
	if h == 0 {
		return reply{}, 0, fmt.Errorf("unknown reply op 0x%02x", op)
	}
	if len(buf) < h {
		return reply{}, 0, errNeedMore
	}
	window := buf[h:]
	if len(window) > maxKeyBytes+1 {
		window = window[:maxKeyBytes+1]
	}
	nl := -1
	for i, c := range window {
		if c == '\n' {
			nl = i
			break
		}
	}
	if nl < 0 {
		if len(window) > maxKeyBytes {
			return reply{}, 0, errors.New("reply key longer than max key bytes")
		}
		return reply{}, 0, errNeedMore
	}
	if nl == 0 {
		return reply{}, 0, errors.New("reply with an empty key")
	}
	key := window[:nl]
	if !utf8.Valid(key) {
		return reply{}, 0, errors.New("reply key is not UTF-8")
	}
	r := reply{op: op, a: binary.BigEndian.Uint64(buf[1:9]), key: string(key)}
	switch op {
	case opAcquire:
		r.owner = binary.BigEndian.Uint64(buf[9:17])
	case opLimitMismatch:
		r.limit = binary.BigEndian.Uint16(buf[9:11])
	}
	return r, h + nl + 1, nil
}
