package rpckit

import (
	"strings"

	"go.opentelemetry.io/otel/attribute"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
)

// rpcMetrics labels a method's measurements with OpenTelemetry's RPC
// conventions, as otelgrpc does: rpc.system.name, rpc.service, rpc.method and
// rpc.response.status_code, the code's canonical name ("INVALID_ARGUMENT"),
// a code past Unauthenticated counting as Unknown.
func rpcMetrics(system, fullMethod string) (attrs []attribute.KeyValue, status func(code int) attribute.KeyValue) {
	method := strings.TrimPrefix(fullMethod, "/")
	service, _, _ := strings.Cut(method, "/")
	return []attribute.KeyValue{
		attribute.String("rpc.system.name", system),
		attribute.String("rpc.service", service),
		attribute.String("rpc.method", method),
	}, statusCodeAttr
}

func statusCodeAttr(code int) attribute.KeyValue {
	if code < 0 || code > int(rpccode.Code_UNAUTHENTICATED) {
		code = int(rpccode.Code_UNKNOWN)
	}
	return attribute.String("rpc.response.status_code", rpccode.Code(code).String())
}
