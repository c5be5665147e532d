package example

// ChargeCreatedDestination is where the server run with -outbox announces
// each charge it writes (PostgresLedger.Announce): a NATS subject, a
// RabbitMQ queue, a Kafka topic.
const ChargeCreatedDestination = "payments.charge.created"

// ChargeCreated is the JSON body of the message that announces a charge:
// what a receipt needs. The message's header "tenant" names its tenant too,
// for a consumer's WithMessageTenant.
type ChargeCreated struct {
	ID       string `json:"id"`
	Tenant   string `json:"tenant"`
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
}
