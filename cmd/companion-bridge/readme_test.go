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

// Every flag a command line of the README or of docs/*.md gives
// companion-bridge (its code blocks, continuation lines joined, and inline
// code spans) is one of its flags: the README's bridge lines are run by no
// test.
func TestDocsCommandLinesNameRealFlags(t *testing.T) {
	var help bytes.Buffer
	m := NewMain()
	m.Stderr = &help
	if err := m.ParseFlags([]string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("ParseFlags(-h) = %v", err)
	}
	flags := map[string]bool{}
	for _, n := range regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`).FindAllStringSubmatch(help.String(), -1) {
		flags[n[1]] = true
	}
	flags["version"] = true // read before the flags: companion-bridge --version
	root := filepath.Join("..", "..")
	paths, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	start := regexp.MustCompile(`^(?:go run \./cmd/)?companion-bridge (.+)$`)
	span := regexp.MustCompile("`([^`\n]+)`")
	flagRE := regexp.MustCompile(`(?:^|\s)--([a-z][a-z0-9-]*)`)
	lines := 0
	for _, path := range append([]string{filepath.Join(root, "README.md")}, paths...) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var cands []string
		inBlock, joined := false, ""
		for _, line := range strings.Split(string(b), "\n") {
			switch {
			case strings.HasPrefix(line, "```"):
				inBlock = !inBlock
			case !inBlock:
				for _, m := range span.FindAllStringSubmatch(line, -1) {
					cands = append(cands, m[1])
				}
			case strings.HasSuffix(line, `\`):
				joined += strings.TrimSuffix(line, `\`) + " "
			default:
				cands = append(cands, joined+line)
				joined = ""
			}
		}
		for _, c := range cands {
			m := start.FindStringSubmatch(strings.TrimSpace(c))
			if m == nil {
				continue
			}
			lines++
			for _, f := range flagRE.FindAllStringSubmatch(m[1], -1) {
				if !flags[f[1]] {
					t.Errorf("%s: `companion-bridge %s`: no flag --%s", filepath.Base(path), m[1], f[1])
				}
			}
		}
	}
	if lines < 2 {
		t.Errorf("%d companion-bridge lines in the docs; the README has two", lines)
	}
}
