package example

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A page token is the base64url (unpadded) of the position of the page's last
// charge, and of the customer_id it lists, hashed so that the token does not
// carry it:
//
//	create_time, seconds since 1970  8 bytes, big-endian
//	create_time, nanoseconds         4 bytes, big-endian
//	SHA-256 of the customer_id       the first 8 bytes
//	id                               the rest
//
// A client may forge a token, but it can only move where a page of its own
// charges starts.
const pageTokenHeader = 8 + 4 + 8

// errPageToken is what the caller gets for any bad token; like every
// message, it does not repeat the token.
var errPageToken = status.Error(codes.InvalidArgument, "page_token is malformed, or was issued for another customer_id")

func encodePageToken(p Position, customerID string) string {
	b := binary.BigEndian.AppendUint64(nil, uint64(p.CreateTime.Unix()))
	b = binary.BigEndian.AppendUint32(b, uint32(p.CreateTime.Nanosecond()))
	b = append(b, customerHash(customerID)...)
	b = append(b, p.ID...)
	return base64.RawURLEncoding.EncodeToString(b)
}

// decodePageToken returns the position in token, which must have been issued
// for customerID. The empty token is the zero Position, the start.
func decodePageToken(token, customerID string) (Position, error) {
	if token == "" {
		return Position{}, nil
	}
	b, err := base64.RawURLEncoding.DecodeString(token)
	if err != nil || len(b) <= pageTokenHeader || !bytes.Equal(b[12:pageTokenHeader], customerHash(customerID)) {
		return Position{}, errPageToken
	}
	secs, nanos := int64(binary.BigEndian.Uint64(b)), binary.BigEndian.Uint32(b[8:])
	p := Position{CreateTime: time.Unix(secs, int64(nanos)).UTC(), ID: string(b[pageTokenHeader:])}
	// Keep what PostgreSQL would refuse out of the query: a time outside the
	// years the example's charges can have, an id that is not text.
	if secs < 0 || nanos >= 1e9 || p.CreateTime.Year() > 9999 || !utf8.ValidString(p.ID) || strings.ContainsRune(p.ID, 0) {
		return Position{}, errPageToken
	}
	return p, nil
}

func customerHash(customerID string) []byte {
	h := sha256.Sum256([]byte(customerID))
	return h[:8]
}
