package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func writeCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ca"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// --ca applies to an mqtts:// broker and to the API client; a plain
// tcp:// broker gets no TLS settings.
func TestTLSClients(t *testing.T) {
	ca := writeCA(t)
	for _, tt := range []struct {
		url     string
		wantTLS bool
	}{
		{"tcp://127.0.0.1:1883", false},
		{"mqtt://127.0.0.1:1883", false},
		{"mqtts://127.0.0.1:8883", true},
		{"ssl://127.0.0.1:8883", true},
		{"tls://127.0.0.1:8883", true},
	} {
		conf, hc, err := tlsClients(tt.url, ca)
		if err != nil {
			t.Fatalf("tlsClients(%q) = %v", tt.url, err)
		}
		if (conf != nil) != tt.wantTLS {
			t.Errorf("tlsClients(%q) TLS config = %v; want TLS %v", tt.url, conf != nil, tt.wantTLS)
		}
		if conf != nil && conf.RootCAs == nil {
			t.Errorf("tlsClients(%q) ignores --ca", tt.url)
		}
		if hc == nil {
			t.Errorf("tlsClients(%q) gave no HTTP client", tt.url)
		}
	}
	if _, _, err := tlsClients("mqtts://x", filepath.Join(t.TempDir(), "missing.pem")); err == nil {
		t.Error("a missing --ca file was accepted")
	} else if !strings.HasPrefix(err.Error(), "--ca: ") {
		t.Errorf("a missing --ca file: %v; want the error to name the flag", err)
	}
	junk := filepath.Join(t.TempDir(), "junk.pem")
	os.WriteFile(junk, []byte("not a certificate"), 0o600)
	if _, _, err := tlsClients("mqtts://x", junk); err == nil {
		t.Error("a --ca file without certificates was accepted")
	}
}
