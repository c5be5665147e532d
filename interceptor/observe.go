package interceptor

import (
	"strings"

	"go.opentelemetry.io/otel/attribute"
	rpccode "google.golang.org/genproto/googleapis/rpc/code"
	"google.golang.org/grpc/codes"

	"github.com/idemkey/idemkey/engine"
)

// grpcMetrics labels a method's measurements as otelgrpc labels its own, so
// that the two can be joined: rpc.method is "package.Service/Method", and
// rpc.response.status_code the code's canonical name ("OK",
// "INVALID_ARGUMENT").
func grpcMetrics(fullMethod string) engine.MetricsSpec {
	method := strings.TrimPrefix(fullMethod, "/")
	service, _, _ := strings.Cut(method, "/")
	return engine.MetricsSpec{
		Attributes: []attribute.KeyValue{
			attribute.String("rpc.system.name", "grpc"),
			attribute.String("rpc.service", service),
			attribute.String("rpc.method", method),
		},
		Status: statusCodeAttr,
	}
}

func statusCodeAttr(code int) attribute.KeyValue {
	if code < 0 || code > int(codes.Unauthenticated) {
		code = int(codes.Unknown)
	}
	return attribute.String("rpc.response.status_code", rpccode.Code(code).String())
}
