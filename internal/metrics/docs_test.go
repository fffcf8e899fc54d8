package metrics_test

import (
	"context"
	"encoding/json"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.yaml.in/yaml/v3"

	"github.com/devicecompanion/companion/internal/metrics"
	"github.com/devicecompanion/companion/internal/testenv"
)

// docMetric is a row of docs/operations.md's tables of metrics.
type docMetric struct {
	name, typ string
	labels    []string
}

// annotations holds, by alert, the text of its annotations, once
// operationsDoc has read them.
var annotations map[string]string

// operationsDoc returns docs/operations.md, the rows of its tables of
// metrics, and the PromQL expressions it gives: its promql blocks and the
// expr of every rule of its alerts file, by the alert's name ("" for a
// promql block); the rules' annotations go in annotations.
func operationsDoc(tb testing.TB) (rows []docMetric, exprs map[string]string) {
	tb.Helper()
	md := string(testenv.ReadRepoFile(tb, "docs/operations.md"))
	row := regexp.MustCompile("(?m)^\\| `(companion_[a-z_]+)` \\| ([a-z]+) \\|([^|]*)\\|")
	tick := regexp.MustCompile("`([a-z_]+)`")
	for _, m := range row.FindAllStringSubmatch(md, -1) {
		r := docMetric{name: m[1], typ: m[2]}
		for _, l := range tick.FindAllStringSubmatch(m[3], -1) {
			r.labels = append(r.labels, l[1])
		}
		rows = append(rows, r)
	}
	exprs = map[string]string{}
	annotations = map[string]string{}
	block := regexp.MustCompile("(?s)```(promql|yaml)\n(.*?)```")
	for _, m := range block.FindAllStringSubmatch(md, -1) {
		if m[1] == "promql" {
			exprs[""] += m[2]
			continue
		}
		if !strings.Contains(m[2], "groups:") {
			continue
		}
		var rules struct {
			Groups []struct {
				Name  string
				Rules []struct {
					Alert, Expr string
					Annotations map[string]string
				}
			}
		}
		if err := yaml.Unmarshal([]byte(m[2]), &rules); err != nil {
			tb.Fatalf("docs/operations.md: the alerts file is not YAML: %v", err)
		}
		for _, g := range rules.Groups {
			for _, r := range g.Rules {
				if r.Alert == "" || r.Expr == "" {
					tb.Errorf("docs/operations.md: a rule of %s without alert or expr: %+v", g.Name, r)
				}
				exprs[r.Alert] = r.Expr
				for _, text := range r.Annotations {
					annotations[r.Alert] += text + "\n"
				}
			}
		}
	}
	return rows, exprs
}

// operation is a method and a route of the API, as the HTTP metrics'
// labels name them, and whether it takes Prefer: wait.
type operation struct {
	method, route string
	waits         bool
}

// apiOperations returns the operations of api/openapi.json.
func apiOperations(tb testing.TB) []operation {
	tb.Helper()
	var doc struct {
		Paths map[string]map[string]json.RawMessage
	}
	if err := json.Unmarshal(testenv.ReadRepoFile(tb, "api/openapi.json"), &doc); err != nil {
		tb.Fatal(err)
	}
	param := regexp.MustCompile(`\{([a-z_]+)\}`)
	var ops []operation
	for path, item := range doc.Paths {
		route := param.ReplaceAllString(path, ":$1")
		for method, op := range item {
			if method == "parameters" || strings.HasPrefix(method, "x-") || method == "summary" || method == "description" {
				continue
			}
			ops = append(ops, operation{
				method: strings.ToUpper(method),
				route:  route,
				waits:  strings.Contains(string(op), `"#/components/parameters/Prefer"`) || strings.Contains(string(op), `"name": "Prefer"`) || strings.Contains(string(op), `"name":"Prefer"`),
			})
		}
	}
	sort.Slice(ops, func(i, j int) bool { return ops[i].route+ops[i].method < ops[j].route+ops[j].method })
	return ops
}

// servedFamilies returns the metric families of both binaries, with the
// HTTP metrics' series of every operation of api/openapi.json.
func servedFamilies(tb testing.TB, ops []operation) map[string]*dto.MetricFamily {
	tb.Helper()
	s := metrics.NewServer(metrics.ServerOptions{
		OpenCommands: func(context.Context) (int, error) { return 0, nil },
		Undecodable:  func() int { return 0 },
		StoreFaults:  func(fn func(string, bool)) { fn("cannot write", false) },
		Logger:       metricsQuiet(),

		IdentityProviderUnavailable:   func() bool { return false },
		IdentityProviderMisconfigured: func() bool { return false },
	})
	for _, op := range ops {
		for _, code := range []int{200, 503} {
			s.Request(op.method, op.route, code, time.Millisecond)
		}
	}
	b := metrics.NewBridge(metrics.BridgeOptions{Devices: 1, ConnectedDevices: func() int { return 1 }})
	fams := map[string]*dto.MetricFamily{}
	for _, reg := range []*prometheus.Registry{s.Registry(), b.Registry()} {
		got, err := reg.Gather()
		if err != nil {
			tb.Fatal(err)
		}
		for _, f := range got {
			fams[f.GetName()] = f
		}
	}
	return fams
}

func labelNames(f *dto.MetricFamily) []string {
	var names []string
	for _, m := range f.GetMetric() {
		for _, l := range m.GetLabel() {
			if !slices.Contains(names, l.GetName()) {
				names = append(names, l.GetName())
			}
		}
	}
	sort.Strings(names)
	return names
}

// Every metric docs/operations.md's tables name is served by one of the
// binaries, of that type and with those labels, and every metric of the
// service that is served is in a table.
func TestOperationsDocTablesAreTheServedMetrics(t *testing.T) {
	rows, _ := operationsDoc(t)
	if len(rows) < 15 {
		t.Fatalf("%d rows of metrics in docs/operations.md", len(rows))
	}
	fams := servedFamilies(t, apiOperations(t))
	documented := map[string]bool{}
	for _, r := range rows {
		documented[r.name] = true
		f := fams[r.name]
		if f == nil {
			t.Errorf("docs/operations.md: %s is served by neither binary", r.name)
			continue
		}
		if typ := strings.ToLower(f.GetType().String()); typ != r.typ {
			t.Errorf("docs/operations.md: %s is a %s; served as a %s", r.name, r.typ, typ)
		}
		want := slices.Clone(r.labels)
		sort.Strings(want)
		if got := labelNames(f); !slices.Equal(got, want) {
			t.Errorf("docs/operations.md: %s has labels %q; served with %q", r.name, want, got)
		}
	}
	for name := range fams {
		if strings.HasPrefix(name, "companion_") && !documented[name] {
			t.Errorf("%s is served and not in docs/operations.md's tables", name)
		}
	}
}

var (
	selectorRE = regexp.MustCompile(`\b((?:companion|process|go)_[a-z_]+|up)\b(\{[^}]*\})?`)
	matcherRE  = regexp.MustCompile(`([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"`)
	groupingRE = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
)

// matcher is a label matcher of a PromQL selector.
type matcher struct {
	label, op, value string
}

func (m matcher) matches(v string) bool {
	switch m.op {
	case "=":
		return v == m.value
	case "!=":
		return v != m.value
	}
	ok := regexp.MustCompile("^(?:" + m.value + ")$").MatchString(v)
	return ok == (m.op == "=~")
}

// Every series an expression of docs/operations.md (its promql blocks and
// its alerts) selects is served: the metric (a histogram's _bucket, _sum
// and _count included), each label it matches or groups by, and for each
// alternative of a value it asks for, a series that has it. Prometheus
// evaluates a selector of a misspelt name or value to nothing, and the
// alert then never fires.
func TestOperationsDocExpressionsSelectServedSeries(t *testing.T) {
	_, exprs := operationsDoc(t)
	if len(exprs) < 15 {
		t.Fatalf("%d expressions in docs/operations.md", len(exprs))
	}
	fams := servedFamilies(t, apiOperations(t))
	for alert, expr := range exprs {
		where := "docs/operations.md: alert " + alert
		if alert == "" {
			where = "docs/operations.md: promql block"
		}
		labels := map[string]bool{"instance": true, "job": true}
		for _, sel := range selectorRE.FindAllStringSubmatch(expr, -1) {
			name := sel[1]
			if name == "up" || strings.HasPrefix(name, "process_") || strings.HasPrefix(name, "go_") {
				continue // the Go and process collectors', and Prometheus's own
			}
			f, base := fams[name], name
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if f == nil && strings.HasSuffix(name, suffix) {
					base = strings.TrimSuffix(name, suffix)
					if h := fams[base]; h != nil && h.GetType() == dto.MetricType_HISTOGRAM {
						f = h
						if suffix == "_bucket" {
							labels["le"] = true
						}
					}
				}
			}
			if f == nil {
				t.Errorf("%s: %s is not served", where, name)
				continue
			}
			names := labelNames(f)
			for _, n := range names {
				labels[n] = true
			}
			for _, m := range matcherRE.FindAllStringSubmatch(sel[2], -1) {
				mt := matcher{m[1], m[2], m[3]}
				if !slices.Contains(names, mt.label) {
					if mt.label != "job" && mt.label != "instance" {
						t.Errorf("%s: %s has no label %s", where, base, mt.label)
					}
					continue
				}
				if mt.op != "=" && mt.op != "=~" {
					continue
				}
				alts := []string{mt.value}
				if mt.op == "=~" && !strings.ContainsAny(mt.value, "()") {
					alts = strings.Split(mt.value, "|")
				}
				for _, alt := range alts {
					one := matcher{mt.label, mt.op, alt}
					if !slices.ContainsFunc(f.GetMetric(), func(s *dto.Metric) bool { return one.matches(labelValue(s, mt.label)) }) {
						t.Errorf("%s: no series of %s has %s %s %q", where, base, mt.label, mt.op, alt)
					}
				}
			}
		}
		for _, g := range groupingRE.FindAllStringSubmatch(expr, -1) {
			for _, l := range strings.Split(g[1], ",") {
				if l = strings.TrimSpace(l); l != "" && !labels[l] {
					t.Errorf("%s: groups by %s, a label of none of its series", where, l)
				}
			}
		}
	}
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// An alert of docs/operations.md on the HTTP latency selects no operation
// that Prefer: wait holds (api/openapi.json): such a request takes up to
// 60 s by design, its client asked for it, and an alert on it fires
// whenever clients wait (docs/reliability.md, bug 416).
func TestOperationsDocLatencyAlertsLeaveWaitsOut(t *testing.T) {
	_, exprs := operationsDoc(t)
	ops := apiOperations(t)
	if !slices.ContainsFunc(ops, func(o operation) bool { return o.waits }) {
		t.Fatal("api/openapi.json: no operation takes Prefer")
	}
	for alert, expr := range exprs {
		if alert == "" {
			continue
		}
		for _, sel := range selectorRE.FindAllStringSubmatch(expr, -1) {
			if sel[1] != "companion_http_request_duration_seconds_bucket" {
				continue
			}
			var ms []matcher
			for _, m := range matcherRE.FindAllStringSubmatch(sel[2], -1) {
				ms = append(ms, matcher{m[1], m[2], m[3]})
			}
			for _, op := range ops {
				if !op.waits {
					continue
				}
				labels := map[string]string{"method": op.method, "route": op.route}
				if !slices.ContainsFunc(ms, func(m matcher) bool { v, ok := labels[m.label]; return ok && !m.matches(v) }) {
					t.Errorf("docs/operations.md: alert %s takes the latency of %s %s, which Prefer: wait holds by design", alert, op.method, op.route)
				}
			}
		}
	}
}

// An alert of docs/operations.md on the HTTP answers counts the API's, not
// the probes of /readyz, which answers 503 by design while the server is
// not ready (its MQTT connection or its store away, each with an alert of
// its own), to a load balancer that probes it every few seconds whatever
// the traffic (docs/reliability.md, bug 417).
func TestOperationsDocHTTPAlertsLeaveProbesOut(t *testing.T) {
	_, exprs := operationsDoc(t)
	for alert, expr := range exprs {
		if alert == "" {
			continue
		}
		for _, sel := range selectorRE.FindAllStringSubmatch(expr, -1) {
			if sel[1] != "companion_http_requests_total" {
				continue
			}
			var ms []matcher
			for _, m := range matcherRE.FindAllStringSubmatch(sel[2], -1) {
				ms = append(ms, matcher{m[1], m[2], m[3]})
			}
			for _, route := range []string{"/readyz", "/healthz"} {
				labels := map[string]string{"method": "GET", "route": route, "code": "503"}
				if !slices.ContainsFunc(ms, func(m matcher) bool { v, ok := labels[m.label]; return ok && !m.matches(v) }) {
					t.Errorf("docs/operations.md: alert %s counts the answers of %s: %s", alert, route, sel[0])
				}
			}
		}
	}
}

// The summary of each alert of docs/operations.md names only labels its
// expression keeps: those of every aggregation's by (all of them, less
// le, histogram_quantile's), or, with no aggregation, those of its series
// and Prometheus's instance and job. A label the expression drops renders
// "<no value>" in the page an operator gets.
func TestOperationsDocAlertSummariesUseKeptLabels(t *testing.T) {
	_, exprs := operationsDoc(t)
	fams := servedFamilies(t, apiOperations(t))
	aggregation := regexp.MustCompile(`\b(?:sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\)\s*)?\(`)
	used := regexp.MustCompile(`\$labels\.([a-z_]+)`)
	checked := 0
	for alert, expr := range exprs {
		if alert == "" {
			continue
		}
		var kept map[string]bool
		if aggs := aggregation.FindAllStringSubmatch(expr, -1); len(aggs) > 0 {
			for _, a := range aggs {
				by := map[string]bool{}
				for _, l := range strings.Split(a[1], ",") {
					if l = strings.TrimSpace(l); l != "" && !(l == "le" && strings.Contains(expr, "histogram_quantile")) {
						by[l] = true
					}
				}
				if kept == nil {
					kept = by
					continue
				}
				for l := range kept {
					if !by[l] {
						delete(kept, l)
					}
				}
			}
		} else {
			kept = map[string]bool{"instance": true, "job": true}
			for _, sel := range selectorRE.FindAllStringSubmatch(expr, -1) {
				if f := fams[sel[1]]; f != nil {
					for _, l := range labelNames(f) {
						kept[l] = true
					}
				}
			}
		}
		for _, m := range used.FindAllStringSubmatch(annotations[alert], -1) {
			checked++
			if !kept[m[1]] {
				t.Errorf("docs/operations.md: alert %s's annotations use $labels.%s, which its expression does not keep", alert, m[1])
			}
		}
	}
	if checked < 10 {
		t.Fatalf("%d labels used in the alerts' annotations", checked)
	}
}
