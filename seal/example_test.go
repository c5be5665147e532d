package seal_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkey/idemkey/engine"
	"github.com/idemkey/idemkey/idemhttp"
	"github.com/idemkey/idemkey/seal"
	"github.com/idemkey/idemkey/store"
	"github.com/idemkey/idemkey/store/memory"
)

// A key ring given to the engine: every recorded reply is sealed on its way
// to the store and opened on its way back, so a retry gets the reply while
// the store holds only its sealed form.
func ExampleNewKeyRing() {
	// In production: seal.ReadKeyFile("/etc/payments/seal.key"), a file made
	// with `openssl rand -hex 32 > seal.key`.
	primary, err := seal.DecodeKey([]byte("9f1c2a7b4e5d6c8f0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f6071"))
	if err != nil {
		panic(err)
	}
	ring, err := seal.NewKeyRing(primary)
	if err != nil {
		panic(err)
	}
	st := memory.New()
	eng, err := engine.New(st, engine.WithSingleTenant(), engine.WithSealer(ring))
	if err != nil {
		panic(err)
	}
	idem, err := idemhttp.Middleware(eng)
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/cards", idem(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":"card_1","last4":"4242"}`)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	const key = "5a0e7f0c-9d1b-4c2e-8f3a-6b7c8d9e0f1a"
	for range 2 { // a call, and its retry
		req, _ := http.NewRequest("POST", srv.URL+"/v1/cards", strings.NewReader(`{"number":"4242424242424242"}`))
		req.Header.Set("Idempotency-Key", `"`+key+`"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(body))
	}

	// What the store holds for the key: sealed, naming the key that sealed it.
	rec, _, err := st.Find(context.Background(), store.ScopeKey("", "POST /v1/cards", key))
	if err != nil {
		panic(err)
	}
	keyID, sealed := seal.SealedWith(rec.Outcome)
	fmt.Println("sealed:", sealed, "with the primary key:", keyID == ring.PrimaryKeyID())
	fmt.Println("the card's digits in the store:", strings.Contains(string(rec.Outcome), "4242"))
	// Output:
	// 201 false {"id":"card_1","last4":"4242"}
	// 201 true {"id":"card_1","last4":"4242"}
	// sealed: true with the primary key: true
	// the card's digits in the store: false
}

// Rotating keys: a ring whose primary key is new, with the old one as a
// previous key, opens what the old ring sealed; a ring without the old key
// refuses it, and a record opens only for the key it was sealed for.
func ExampleWithPreviousKeys() {
	oldKey := make([]byte, seal.KeySize) // keys of the example; yours are random
	newKey := make([]byte, seal.KeySize)
	for i := range seal.KeySize {
		oldKey[i], newKey[i] = byte(i+1), byte(i+101)
	}
	charge := store.ScopeKey("acme", "/payments.v1.Payments/Charge", "k1") // a record's scope
	oldRing, _ := seal.NewKeyRing(oldKey)
	record, _ := oldRing.Seal(charge, []byte("reply"))

	rotated, err := seal.NewKeyRing(newKey, seal.WithPreviousKeys(oldKey))
	if err != nil {
		panic(err)
	}
	reply, err := rotated.Open(charge, record)
	fmt.Printf("%s %v\n", reply, err)

	newOnly, _ := seal.NewKeyRing(newKey)
	_, err = newOnly.Open(charge, record)
	fmt.Println("without the old key:", errors.Is(err, seal.ErrUnknownKey))

	_, err = rotated.Open(store.ScopeKey("acme", "/payments.v1.Payments/Charge", "k2"), record) // another key's record
	fmt.Println("copied to another key:", errors.Is(err, seal.ErrNotAuthentic))
	// Output:
	// reply <nil>
	// without the old key: true
	// copied to another key: true
}
