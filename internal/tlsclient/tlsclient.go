// Package tlsclient builds the TLS client settings the server and the
// bridge share: verifying a broker or an API with a PEM CA bundle, and
// telling which broker URLs paho dials over TLS.
package tlsclient

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
)

// Config returns client settings that verify servers with the PEM
// certificates in caFile, or with the system's roots when caFile is "".
func Config(caFile string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile == "" {
		return c, nil
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	c.RootCAs = x509.NewCertPool()
	if !c.RootCAs.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no PEM certificates", caFile)
	}
	return c, nil
}

// HTTPClient returns an HTTP client whose TLS connections use c.
func HTTPClient(c *tls.Config) *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.TLSClientConfig = c.Clone()
	return &http.Client{Transport: t}
}

// BrokerURLs splits a comma-separated list of broker URLs (a cluster's
// nodes, which paho tries in turn and fails over between), dropping empty
// entries. All must be TLS or none: one TLS setting serves them all.
func BrokerURLs(list string) ([]string, error) {
	var urls []string
	for _, u := range strings.Split(list, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	if len(urls) == 0 {
		return nil, fmt.Errorf("no broker URL in %q", list)
	}
	for _, u := range urls {
		if err := checkBrokerURL(u); err != nil {
			return nil, err
		}
	}
	for _, u := range urls[1:] {
		if IsTLSURL(u) != IsTLSURL(urls[0]) {
			return nil, fmt.Errorf("broker URLs %s and %s: all TLS or none", urls[0], u)
		}
	}
	return urls, nil
}

// checkBrokerURL refuses a broker URL that paho would take and then fail
// to dial on every try, forever (a scheme it has no dialer for, a TCP
// address without a port). It reads u as paho's AddBroker does: ":1883"
// is 127.0.0.1's, and a URL without a scheme is tcp://. Credentials are
// not named in the message (HasCredentials).
func checkBrokerURL(u string) error {
	s := u
	if strings.HasPrefix(s, ":") {
		s = "127.0.0.1" + s
	}
	if !strings.Contains(s, "://") {
		s = "tcp://" + s
	}
	p, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("broker URL %q: %w", redact(u), err)
	}
	switch p.Scheme {
	case "tcp", "mqtt", "ssl", "tls", "mqtts", "mqtt+ssl", "tcps":
		if p.Hostname() == "" || p.Port() == "" {
			return fmt.Errorf("broker URL %q: needs a host and a port (tcp://HOST:1883, mqtts://HOST:8883)", redact(u))
		}
	case "ws", "wss":
		if p.Hostname() == "" {
			return fmt.Errorf("broker URL %q: needs a host", redact(u))
		}
	case "unix":
		if p.Path == "" && p.Host == "" {
			return fmt.Errorf("broker URL %q: needs a socket path", redact(u))
		}
	default:
		return fmt.Errorf("broker URL %q: scheme %q is not one of tcp, mqtt, ssl, tls, mqtts, mqtt+ssl, tcps, ws, wss, unix", redact(u), p.Scheme)
	}
	return nil
}

// redact returns u without what comes before an "@" after its scheme.
func redact(u string) string {
	if scheme, rest, ok := strings.Cut(u, "://"); ok {
		if _, host, ok := strings.Cut(rest, "@"); ok {
			return scheme + "://…@" + host
		}
		return u
	}
	if _, host, ok := strings.Cut(u, "@"); ok {
		return "…@" + host
	}
	return u
}

// HasCredentials reports whether a URL of list (comma-separated broker
// URLs) holds credentials (user:password@), which paho would log in with
// and the binaries would print and log with the URL: any "@" after the
// scheme (paho takes a URL without one as tcp://).
func HasCredentials(list string) bool {
	for _, u := range strings.Split(list, ",") {
		if _, rest, ok := strings.Cut(u, "://"); ok {
			u = rest
		}
		if strings.Contains(u, "@") {
			return true
		}
	}
	return false
}

// IsTLSURL reports whether paho dials a broker URL (the first of a list)
// over TLS.
func IsTLSURL(url string) bool {
	url, _, _ = strings.Cut(url, ",")
	scheme, _, _ := strings.Cut(strings.TrimSpace(url), "://")
	switch scheme {
	case "ssl", "tls", "mqtts", "mqtt+ssl", "tcps", "wss":
		return true
	}
	return false
}
