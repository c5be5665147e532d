// Package redaction runs an application's redaction function on a copy of
// a protobuf reply before it is recorded, and checks what it left, the same
// way for the gRPC interceptor and idemconnect.
package redaction

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Apply calls redact, which changes the reply whose error and response
// errp and respp point to, and returns an error if what it left cannot be
// recorded in the reply's place: it panicked, turned the handler's error
// (herr) into a response, left neither, or replaced the response, of type
// name, by another type. An error keeps the handler's key from being
// released: the handler has run.
func Apply(herr error, name protoreflect.FullName, errp *error, respp *proto.Message, redact func()) (err error) {
	defer func() {
		if p := recover(); p != nil {
			// A redaction function handles secrets: its panic's words may
			// quote the reply it was removing them from.
			err = fmt.Errorf("the redaction function panicked with a value of type %T (its words are not logged: they may quote the reply)", p)
		}
	}()
	redact()
	switch resp := *respp; {
	case *errp != nil:
	case herr != nil:
		return errors.New("the redaction function turned an error into a response")
	case resp == nil:
		return errors.New("the redaction function left neither a response nor an error")
	case resp.ProtoReflect().Descriptor().FullName() != name:
		return fmt.Errorf("the redaction function replaced the %s response by a %s", name, resp.ProtoReflect().Descriptor().FullName())
	}
	return nil
}
