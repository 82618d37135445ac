package edge

import (
	"strconv"
	"strings"
	"time"
)

// PushbackKey is the trailer in which a gRPC server tells a client when to
// retry, in whole milliseconds (gRPC's retry design, A6): a non-negative
// value is a delay to honour, a negative or malformed one means "do not
// retry". Package servegrpc sends it with a refusal and package sdkgrpc
// reads it, both with the functions here.
const PushbackKey = "grpc-retry-pushback-ms"

// ParsePushback reads a PushbackKey value: ok is false for a negative or
// malformed one, which means "do not retry".
func ParsePushback(s string) (time.Duration, bool) {
	ms, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil || ms < 0 {
		return 0, false
	}
	return time.Duration(min(ms, int64(1<<63-1)/int64(time.Millisecond))) * time.Millisecond, true
}

// FormatPushback formats d as a PushbackKey value: whole milliseconds,
// rounded up, so that a client waiting as long as it is told arrives after
// the permit it was told of.
func FormatPushback(d time.Duration) string {
	ms := d / time.Millisecond
	if d%time.Millisecond != 0 {
		ms++
	}
	return strconv.FormatInt(int64(max(ms, 0)), 10)
}
