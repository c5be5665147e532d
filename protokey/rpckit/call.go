package rpckit

import (
	"context"
	"fmt"
	"log/slog"

	"google.golang.org/protobuf/proto"

	"github.com/idemkey/idemkey"
	"github.com/idemkey/idemkey/internal/protohash"
	idemkeyv1 "github.com/idemkey/idemkey/proto/idemkey/v1"
	"github.com/idemkey/idemkey/store"
)

// TransportKey reads a call's key from its transport's values with
// idemkey.ParseKey; ok is false when it carries none. A key malformed, sent
// twice or as binary metadata (binary) is an *idemkey.KeyError, which never
// quotes the key.
func TransportKey(values []string, binary bool) (key string, ok bool, err error) {
	switch {
	case binary:
		return "", false, &idemkey.KeyError{Problem: "it was sent as binary metadata"}
	case len(values) == 0:
		return "", false, nil
	case len(values) > 1:
		return "", false, &idemkey.KeyError{Problem: "it was sent more than once"}
	}
	key, err = idemkey.ParseKey(values[0])
	return key, err == nil, err
}

// Key returns the key of a call of m whose transport carried key (ok false
// if it carried none) and whose request is req: the transport's, else the
// one of m's key field (WithKeyField), if m has one. A field key that is
// malformed, or that differs from the transport's, is an *idemkey.KeyError,
// which never quotes either key.
func (m *Method) Key(key string, ok bool, req any) (string, bool, error) {
	msg, _ := req.(proto.Message)
	if m.KeyField == nil || msg == nil {
		return key, ok, nil
	}
	fieldKey := msg.ProtoReflect().Get(m.KeyField).String()
	switch {
	case fieldKey == "":
		return key, ok, nil
	case ok && fieldKey != key:
		return "", false, &idemkey.KeyError{Problem: "the request's " + string(m.KeyField.Name()) + " and the idempotency key sent beside it differ"}
	}
	if err := idemkey.ValidateKey(fieldKey); err != nil {
		return "", false, err
	}
	return fieldKey, true, nil
}

// Fingerprint returns the fingerprint of req, a call of m: f's, or
// protokey.HashRequest's without m's key field. An error of f's that passes
// goes to the caller as it is; any other is logged by its type alone (its
// words may quote the request). st is idemkey's Internal answer to such an
// error, a method missing from the registry, or a request not protobuf.
func (m *Method) Fingerprint(ctx context.Context, log *slog.Logger, req any, f func(string, proto.Message) (store.Fingerprint, error), passes func(error) bool) (fp store.Fingerprint, st *idemkeyv1.Status, err error) {
	if m.Output == nil {
		return fp, Internal("idemkey: the method is not in the protobuf registry, so its replies cannot be replayed"), nil
	}
	msg, ok := req.(proto.Message)
	if !ok {
		return fp, Internal("idemkey: the request is not a protobuf message"), nil
	}
	if f == nil {
		return protohash.Hash(m.Name, msg, m.KeyField), nil, nil
	}
	fp, err = f(m.Name, msg)
	switch {
	case err == nil:
		return fp, nil, nil
	case passes(err):
		return fp, nil, err
	}
	log.LogAttrs(ctx, slog.LevelError, "idemkey: fingerprint failed", slog.String("operation", m.Name),
		slog.String("error", fmt.Sprintf("an error of type %T (its words are not logged: they may quote the request)", err)))
	return fp, Internal("idemkey: the request could not be fingerprinted"), nil
}
