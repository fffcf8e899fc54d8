// Package metricstest scrapes a GET /metrics over HTTP, as Prometheus
// does, and reads figures out of what it got, for the tests of --metrics.
// It parses the text format with the Prometheus parser (expfmt), so a test
// also checks that what is served is well-formed.
package metricstest

import (
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Families are the metric families of one scrape, by name.
type Families map[string]*dto.MetricFamily

// Scrape gets url (http://ADDR/metrics) asking for the text format, checks
// the answer is 200 text/plain, and parses it.
func Scrape(tb testing.TB, url string) Families {
	tb.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		tb.Fatal(err)
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Do(req)
	if err != nil {
		tb.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		tb.Fatalf("scrape %s: %s: %s", url, resp.Status, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		tb.Fatalf("scrape %s: Content-Type %q; want text/plain", url, ct)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		tb.Fatalf("scrape %s: the text format does not parse: %v", url, err)
	}
	return Families(fams)
}

// Labels are a series' labels as name, value pairs.
type Labels []string

// find returns the series of family name whose labels include all of
// labels, or nil.
func (f Families) find(name string, labels Labels) *dto.Metric {
	fam := f[name]
	if fam == nil {
		return nil
	}
	for _, m := range fam.GetMetric() {
		if hasLabels(m, labels) {
			return m
		}
	}
	return nil
}

func hasLabels(m *dto.Metric, labels Labels) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		found := false
		for _, lp := range m.GetLabel() {
			if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// Has reports whether family name has a series with labels.
func (f Families) Has(name string, labels ...string) bool {
	return f.find(name, labels) != nil
}

// Value is the value of a counter or gauge series (0 when absent: a series
// not created yet is a count of 0).
func (f Families) Value(name string, labels ...string) float64 {
	m := f.find(name, labels)
	switch {
	case m == nil:
		return 0
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Untyped != nil:
		return m.Untyped.GetValue()
	}
	return 0
}

// Count is the sample count of a histogram series (0 when absent).
func (f Families) Count(name string, labels ...string) uint64 {
	m := f.find(name, labels)
	if m == nil || m.Histogram == nil {
		return 0
	}
	return m.Histogram.GetSampleCount()
}

// Sum is the sample sum of a histogram series (0 when absent).
func (f Families) Sum(name string, labels ...string) float64 {
	m := f.find(name, labels)
	if m == nil || m.Histogram == nil {
		return 0
	}
	return m.Histogram.GetSampleSum()
}

// Total is the sum of the values of every counter or gauge series of name
// with labels, or of the sample counts of a histogram's.
func (f Families) Total(name string, labels ...string) float64 {
	fam := f[name]
	if fam == nil {
		return 0
	}
	var t float64
	for _, m := range fam.GetMetric() {
		if hasLabels(m, labels) {
			t += sample(m)
		}
	}
	return t
}

// sample is the value of a counter or gauge series, or the sample count of
// a histogram's.
func sample(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

// Dump lists the series of name that have a non-zero value, for failure
// messages.
func (f Families) Dump(name string) string {
	fam := f[name]
	if fam == nil {
		return name + ": absent"
	}
	var lines []string
	for _, m := range fam.GetMetric() {
		v := sample(m)
		if v == 0 {
			continue
		}
		var ls []string
		for _, lp := range m.GetLabel() {
			ls = append(ls, lp.GetName()+"="+lp.GetValue())
		}
		lines = append(lines, fmt.Sprintf("%s{%s} %g", name, strings.Join(ls, ","), v))
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}
