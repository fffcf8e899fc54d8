package main

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The README's Configuration section names every flag of companion-bridge.
func TestReadmeListsEveryFlag(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	i := strings.Index(readme, "\n`companion-bridge`: ")
	if i < 0 {
		t.Fatal("the README has no paragraph of companion-bridge's flags")
	}
	para := readme[i+1:]
	if j := strings.Index(para, "\n\n"); j >= 0 {
		para = para[:j]
	}
	var help bytes.Buffer
	m := NewMain()
	m.Stderr = &help
	if err := m.ParseFlags([]string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("ParseFlags(-h) = %v", err)
	}
	names := regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(help.String(), -1)
	if len(names) < 20 {
		t.Fatalf("%d flags in the help:\n%s", len(names), help.String())
	}
	for _, n := range names {
		if !regexp.MustCompile("(^|[^a-z0-9-])--" + regexp.QuoteMeta(n[1]) + "([^a-z0-9-]|$)").MatchString(para) {
			t.Errorf("the README's companion-bridge flags lack --%s", n[1])
		}
	}
}
