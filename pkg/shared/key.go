package shared

import "strings"

// keyEscaper escapes the separator and the escape character, so that
// distinct partitions under one prefix never make the same key.
var keyEscaper = strings.NewReplacer("%", "%25", "/", "%2F")

// KeyFor returns the key of partition's budget under prefix:
// prefix + "/" + partition, with "/" and "%" in partition escaped as %2F and
// %25, or prefix alone when partition is empty.
//
// Escaping keeps two partitions of one prefix apart ("a/b" cannot collide
// with "a" and "b"), but the prefix is taken as it is: choose prefixes of
// which none is another followed by "/", and keep them apart from every other
// key in the database. Partitions become Redis keys in clear: hash sensitive
// identifiers (user names, addresses) before passing them, and bound how
// many there can be, since each is a key until it expires.
func KeyFor(prefix, partition string) string {
	if partition == "" {
		return prefix
	}
	return prefix + "/" + keyEscaper.Replace(partition)
}
