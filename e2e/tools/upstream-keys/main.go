// upstream-keys reproduces, with the Go standard library and filippo.io/keygen v1.0.0 only, how
// the upstream Jumpstarter controller turns its CONTROLLER_KEY seed into the ES256 key that signs
// its internal tokens, and mints tokens in the form it writes into credential Secrets. ucm's tests
// use it as the independent reference (docs/exporter.md, "Taking over from upstream"):
//
//	upstream-keys golden SEED...      JSON: each seed's private scalar and public key, and a token
//	                                  minted with it that must verify
//	upstream-keys mint SEED SUB IAT EXP
//	                                  one token, as upstream mints it (iss https://localhost:8085,
//	                                  aud [jumpstarter], header alg ES256 typ JWT)
//	upstream-keys public SEED         the public key as SEC1 uncompressed hex
//	upstream-keys cooked              Go's math/rand seed table, read out of the runtime (for
//	                                  src/exporter/auth/gorand_table.rs)
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	crand "crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"reflect"
	"strconv"
	"unsafe"

	"filippo.io/keygen"
)

const (
	issuer   = "https://localhost:8085"
	audience = "jumpstarter"
)

// keyFromSeed: SHA-256 of the seed, its first 8 bytes (big-endian) seed math/rand, whose byte
// stream feeds keygen.ECDSALegacy on P-256.
func keyFromSeed(seed string) *ecdsa.PrivateKey {
	digest := sha256.Sum256([]byte(seed))
	src := rand.NewSource(int64(binary.BigEndian.Uint64(digest[:8])))
	key, err := keygen.ECDSALegacy(elliptic.P256(), rand.New(src))
	if err != nil {
		panic(err)
	}
	return key
}

func publicHex(key *ecdsa.PrivateKey) string {
	b, err := key.PublicKey.ECDH()
	if err != nil {
		panic(err)
	}
	return hex.EncodeToString(b.Bytes())
}

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

// mint signs {iss, sub, aud, exp, iat} with ES256, r||s fixed width, as a JWT library does.
func mint(key *ecdsa.PrivateKey, sub string, iat, exp int64) string {
	header, _ := json.Marshal(map[string]string{"alg": "ES256", "typ": "JWT"})
	claims, _ := json.Marshal(struct {
		Iss string   `json:"iss"`
		Sub string   `json:"sub"`
		Aud []string `json:"aud"`
		Exp int64    `json:"exp"`
		Iat int64    `json:"iat"`
	}{issuer, sub, []string{audience}, exp, iat})
	input := b64(header) + "." + b64(claims)
	digest := sha256.Sum256([]byte(input))
	r, s, err := ecdsa.Sign(crand.Reader, key, digest[:])
	if err != nil {
		panic(err)
	}
	sig := make([]byte, 64)
	r.FillBytes(sig[:32])
	s.FillBytes(sig[32:])
	return input + "." + b64(sig)
}

// seedrand is math/rand's seeding LCG (x[n+1] = 48271 * x[n] mod 2**31 - 1), needed to take the
// seeded part back out of a source's state.
func seedrand(x int32) int32 {
	const a, q, r = 48271, 44488, 3399
	hi, lo := x/q, x%q
	x = a*lo - r*hi
	if x < 0 {
		x += 0x7fffffff
	}
	return x
}

// cooked reads a freshly seeded source's state and removes the seed's contribution, leaving the
// constant table every seeded source starts from.
func cooked() [607]uint64 {
	src := rand.NewSource(1)
	vec := reflect.ValueOf(src).Elem().FieldByName("vec")
	state := *(*[607]int64)(unsafe.Pointer(vec.UnsafeAddr()))
	var out [607]uint64
	x := int32(1)
	for i := -20; i < 607; i++ {
		x = seedrand(x)
		if i >= 0 {
			u := int64(x) << 40
			x = seedrand(x)
			u ^= int64(x) << 20
			x = seedrand(x)
			u ^= int64(x)
			out[i] = uint64(state[i] ^ u)
		}
	}
	return out
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: upstream-keys golden SEED... | mint SEED SUB IAT EXP | public SEED | cooked")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "golden":
		type vector struct {
			Seed   string `json:"seed"`
			Scalar string `json:"scalar"`
			Public string `json:"public"`
			Sub    string `json:"sub"`
			Token  string `json:"token"`
		}
		var out []vector
		for _, seed := range os.Args[2:] {
			key := keyFromSeed(seed)
			sub := "exporter:lab:board-1:" + strconv.Itoa(len(out))
			out = append(out, vector{seed, hex.EncodeToString(key.D.FillBytes(make([]byte, 32))), publicHex(key), sub,
				mint(key, sub, 1767225600, 4102444800)})
		}
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(out); err != nil {
			panic(err)
		}
	case "mint":
		if len(os.Args) != 6 {
			fmt.Fprintln(os.Stderr, "usage: upstream-keys mint SEED SUB IAT EXP")
			os.Exit(2)
		}
		iat, err1 := strconv.ParseInt(os.Args[4], 10, 64)
		exp, err2 := strconv.ParseInt(os.Args[5], 10, 64)
		if err1 != nil || err2 != nil {
			fmt.Fprintln(os.Stderr, "IAT and EXP are Unix seconds")
			os.Exit(2)
		}
		fmt.Println(mint(keyFromSeed(os.Args[2]), os.Args[3], iat, exp))
	case "public":
		fmt.Println(publicHex(keyFromSeed(os.Args[2])))
	case "cooked":
		for i, v := range cooked() {
			fmt.Printf("0x%016x,", v)
			if i%4 == 3 {
				fmt.Println()
			} else {
				fmt.Print(" ")
			}
		}
		fmt.Println()
	default:
		fmt.Fprintln(os.Stderr, "unknown command", os.Args[1])
		os.Exit(2)
	}
}
