package example_test

import (
	"context"

	"github.com/grpc-ecosystem/grpc-gateway/v2/runtime"
	"google.golang.org/grpc"

	paymentsv1gw "github.com/idemkey/idemkey/example/paymentsv1gw"
	"github.com/idemkey/idemkey/idemgateway"
	paymentsv1 "github.com/idemkey/idemkey/proto/example/payments/v1"
)

// gatewayMux is docs/http.md's grpc-gateway snippet, between the markers
// (TestREADMESnippets): a ServeMux in front of conn, with idemkey's options.
func gatewayMux(ctx context.Context, conn *grpc.ClientConn) (*runtime.ServeMux, error) {
	// readme:gateway
	mux := runtime.NewServeMux(idemgateway.ServeMuxOptions()...)
	err := paymentsv1gw.RegisterPaymentServiceHandlerClient(ctx, mux, paymentsv1.NewPaymentServiceClient(conn))
	// end readme
	return mux, err
}

var _ = gatewayMux
