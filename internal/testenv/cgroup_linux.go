package testenv

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// MemoryCgroup makes a memory cgroup of its own under the test process's,
// limited to limit bytes, and returns a shell command that moves the shell
// into it: `sh -c 'MOVE && exec BIN ARGS…'` runs BIN there from its first
// instruction, as a container or a unit with a memory limit runs it. The
// cgroup is removed at cleanup, once whatever ran in it has exited:
// register the process's own cleanup after this call. It fails the test
// (it does not skip it) where cgroups cannot be made: run the tests as
// root on Linux.
func MemoryCgroup(tb testing.TB, limit int64) (move string) {
	tb.Helper()
	dir, file := memoryCgroupDir(tb)
	cg := filepath.Join(dir, "companion-test-"+strconv.Itoa(os.Getpid())+"-"+strconv.FormatInt(time.Now().UnixNano(), 36))
	if file == "memory.max" {
		// cgroup v2 gives a child the controllers its parent enables
		// for its children; the parent may have done so already.
		_ = os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte("+memory"), 0o644)
	}
	if err := os.Mkdir(cg, 0o755); err != nil {
		tb.Fatalf("making a memory cgroup (run the tests as root on Linux): %v", err)
	}
	tb.Cleanup(func() {
		// A process that has just exited can hold the cgroup a moment.
		deadline := time.Now().Add(10 * time.Second)
		for os.Remove(cg) != nil && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond) // polling the kernel's release of the cgroup
		}
	})
	if err := os.WriteFile(filepath.Join(cg, file), []byte(strconv.FormatInt(limit, 10)), 0o644); err != nil {
		tb.Fatalf("limiting the cgroup's memory: %v", err)
	}
	return "echo $$ > " + filepath.Join(cg, "cgroup.procs")
}

// memoryCgroupDir is the directory of this process's memory cgroup and
// the name of its limit file there: cgroup v1's memory controller where it
// is mounted, v2's unified hierarchy otherwise.
func memoryCgroupDir(tb testing.TB) (dir, limitFile string) {
	tb.Helper()
	f, err := os.Open("/proc/self/cgroup")
	if err != nil {
		tb.Fatalf("memory cgroup: %v", err)
	}
	defer f.Close()
	var v1, v2 string
	for sc := bufio.NewScanner(f); sc.Scan(); {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			v2 = parts[2]
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "memory" {
				v1 = parts[2]
			}
		}
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		tb.Fatalf("memory cgroup: %v", err)
	}
	var v1Mount, v2Mount string
	for _, l := range strings.Split(string(mounts), "\n") {
		// mountinfo: ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS… - FSTYPE SOURCE SUPEROPTIONS
		fields := strings.Fields(l)
		sep := -1
		for i, x := range fields {
			if x == "-" {
				sep = i
			}
		}
		if sep < 0 || sep+3 >= len(fields) || fields[3] != "/" {
			continue
		}
		switch fields[sep+1] {
		case "cgroup":
			for _, o := range strings.Split(fields[sep+3], ",") {
				if o == "memory" {
					v1Mount = fields[4]
				}
			}
		case "cgroup2":
			v2Mount = fields[4]
		}
	}
	switch {
	case v1 != "" && v1Mount != "":
		return filepath.Join(v1Mount, v1), "memory.limit_in_bytes"
	case v2Mount != "":
		return filepath.Join(v2Mount, v2), "memory.max"
	}
	tb.Fatalf("memory cgroup: no memory controller mounted (/proc/self/cgroup and /proc/self/mountinfo)")
	return "", ""
}
